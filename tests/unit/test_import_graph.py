"""WavePP is layered: no import cycle among its modules, and no module imports a later
layer (``LAYERS``).

The cycle check reads an edge for every import a module runs when it is loaded (top
level, ``if`` and ``try`` blocks; not imports inside functions, which run later, nor
``if TYPE_CHECKING:`` ones). Importing ``a.b.c`` loads ``a`` and ``a.b`` first, so those
are edges too, except to the importing module's own packages. The layer check reads
every import, wherever it stands. Both read the source (``ast``) of ``wavepp`` and of the
experiments in ``benchmarks``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


_TOPS = ("wavepp", "benchmarks")


def _modules() -> dict[str, Path]:
    out = {}
    for path in (p for top in _TOPS for p in (ROOT / top).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _load_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
            todo += [n for handler in node.handlers for n in handler.body]
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = []
        for node in _load_time_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                        for a in node.names]  # fmt: skip
        edges = set()
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                step = ".".join(parts[:i])
                if step in modules and step != name and not name.startswith(step + "."):
                    edges.add(step)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back_through_others():
    assert cycles(import_graph()) == []


def test_the_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert "wavepp.serve.app" in import_graph()["wavepp.serve.server"]


# -- layers -----------------------------------------------------------------------------

# WavePP's layers, lowest first: a module imports only from its own layer and the ones
# before it. A package's ``__main__`` is its launcher and sits with the launchers, above
# everything. Every module falls in a layer: the longest name that is it or a package of
# it (``wavepp`` names only the package's ``__init__``).
LAYERS: tuple[tuple[str, ...], ...] = (
    # leaves: ids, dtype names, errors, numbers, the machine, the ladder's switches,
    # requests to run
    ("wavepp", "wavepp.errors", "wavepp.ids", "wavepp.dtypes", "wavepp.stats", "wavepp.host",
     "wavepp.rungs", "wavepp.workload", "wavepp.signing"),
    ("wavepp.state",),  # the cache's bookkeeping
    ("wavepp.plan",),  # waves and placement
    ("wavepp.policy", "wavepp.queueing"),  # admission policies and their waiting queue
    ("wavepp.rounds",),  # admission rounds and their messages
    ("wavepp.transport", "wavepp.kv_events"),  # links between ranks; KV events (vLLM's)
    ("wavepp.model",),  # the model's math
    ("wavepp.exec", "wavepp.sim", "wavepp.handoff"),  # executors; the cache handoff
    ("wavepp.runtime",),  # one rank's loop
    ("wavepp.engine", "wavepp.metrics", "wavepp.timeline"),  # a run as one object; its record
    ("wavepp.launch", "wavepp.config"),  # run options; starting the ranks
    ("wavepp.serve",),  # the HTTP server
    ("wavepp.route",),  # the router over servers
    # launchers and tools: the run's entry, the server's supervisor, the fleet, the load
    # generator, the decode worker, the policy checker, vLLM's connector (imported by vLLM
    # only), the experiments
    ("wavepp.main", "wavepp.serve.launch", "wavepp.fleet", "wavepp.bench", "wavepp.decode",
     "wavepp.checker", "wavepp.vllm", "benchmarks"),
)


def layer_of(module: str) -> int:
    if module.rpartition(".")[2] == "__main__":
        return len(LAYERS) - 1
    matches = [(len(name), i) for i, names in enumerate(LAYERS) for name in names
               if module == name or (name != "wavepp" and module.startswith(name + "."))]
    if not matches:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return max(matches)[1]


def every_import(source: str, name: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every import of a WavePP module in ``source``, at any depth
    (inside functions and ``if TYPE_CHECKING:`` too)."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base))
    return [(line, target) for line, target in found if target.split(".")[0] in _TOPS]


def upward_imports() -> list[str]:
    """``module:line imports target`` for each import of a later layer."""
    out = []
    for name, path in sorted(_modules().items()):
        for line, target in every_import(path.read_text(), name, path.name == "__init__.py"):
            if layer_of(target) > layer_of(name):
                out.append(f"{name}:{line} imports {target}")
    return out


def test_every_module_has_a_layer():
    for name in _modules():
        layer_of(name)


def test_no_module_imports_a_later_layer():
    assert upward_imports() == []


def test_the_layer_check_sees_an_upward_import():
    assert layer_of("wavepp.state.cache") < layer_of("wavepp.plan.wave") < layer_of("wavepp.model")
    assert layer_of("wavepp.kv_events.index") < layer_of("wavepp.exec.stage")
    assert layer_of("wavepp.launch.backend") < layer_of("wavepp.serve.app")
    assert layer_of("wavepp.serve.__main__") == layer_of("wavepp.main") == len(LAYERS) - 1
    assert layer_of("benchmarks.matrix") == len(LAYERS) - 1
    with pytest.raises(AssertionError, match="no layer"):
        layer_of("wavepp.newcomer")
    source = "def f():\n    from ..engine import Engine\n"
    assert every_import(source, "wavepp.runtime.feed", False) == [(2, "wavepp.engine")]
