"""deploy/: the rendered Kubernetes manifests validate against the Kubernetes schemas
(kubernetes-validate, offline, strict: an unknown field fails), the committed render is
a fresh one, every metric the dashboard, the scrape config, the adapter and the HPA name
is one a running server or router exports, the images install with pinned versions, and
every command the images and manifests run is a real one. No cluster and no container
engine: nothing here starts a pod or builds an image."""

from __future__ import annotations

import json
import re
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from wavepp.serve.prom import parse_exposition

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# The Kubernetes versions validated against: an older one a cluster may still run, and
# the newest kubernetes-validate bundles.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())


# deploy/render.py is no installed module: its names, run from its file
render = SimpleNamespace(**runpy.run_path(str(DEPLOY / "render.py")))

# The committed renders: argv -> directory.
AUTOSCALED = ("--nodes", "1", "--procs-per-node", "8", "--out", "deploy/k8s-autoscaled")
COMMITTED = {(): DEPLOY / "k8s", AUTOSCALED: DEPLOY / "k8s-autoscaled"}
SHAPES = [
    *COMMITTED,
    ("--pipelines", "3", "--nodes", "4", "--procs-per-node", "8", "--decoders", "2"),
    ("--pipelines", "1", "--nodes", "12", "--procs-per-node", "2"),  # worker ordinals ≥ 10
    ("--pipelines", "1", "--nodes", "3", "--device", "cpu", "--procs-per-node", "2",
     "--model", "tiny-llama", "--model-claim", "", "--decoders", "0",
     "--serve-option=--capacity-blocks=4096"),
    ("--pipelines", "3", "--max-pipelines", "8", "--nodes", "1", "--name", "prefill"),
]  # fmt: skip


def _documents(files: dict[str, str]) -> list[dict]:
    return [doc for name, text in files.items() if name.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]  # fmt: skip


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", [])


def _by_kind(files: dict[str, str], kind: str) -> list[dict]:
    return [d for d in _documents(files) if d["kind"] == kind]


def _all_containers(files: dict[str, str]) -> list[tuple[dict, dict]]:
    return [(doc, c) for doc in _documents(files) for c in _containers(doc)]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda argv: " ".join(argv) or "default")
def rendered(request) -> tuple[tuple[str, ...], dict[str, str]]:
    return request.param, render.render(list(request.param))


# -- the schemas ------------------------------------------------------------------------


def test_every_manifest_validates_against_the_kubernetes_schemas(rendered):
    _, files = rendered
    documents = _documents(files)
    assert documents
    for doc in documents:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validation_refuses_an_unknown_field_and_a_wrong_type():
    doc = _by_kind(render.render([]), "Service")[0]
    misspelled = json.loads(json.dumps(doc))
    misspelled["spec"]["selectr"] = misspelled["spec"].pop("selector")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelled, K8S_VERSIONS[-1], strict=True)
    wrong = json.loads(json.dumps(doc))
    wrong["spec"]["ports"][0]["port"] = "twenty-nine thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, K8S_VERSIONS[-1], strict=True)


def test_the_committed_recipe_is_a_fresh_render():
    for argv, directory in COMMITTED.items():
        files = render.render(list(argv))
        on_disk = {p.name: p.read_text() for p in directory.iterdir()}
        assert on_disk == files, f"{directory}: run python deploy/render.py {shlex.join(argv)}"
    monitoring = {p.name: p.read_text() for p in (DEPLOY / "monitoring").iterdir()}
    assert monitoring == render.monitoring(), "deploy/monitoring: run python deploy/render.py"


def test_a_bad_shape_is_refused_with_its_reason():
    for argv, words in [(["--nodes", "0"], "--nodes must be"),
                        (["--pipelines", "2", "--max-pipelines", "1", "--nodes", "1"],
                         "--max-pipelines must be"),
                        (["--max-pipelines", "4"], "for --nodes 1")]:  # fmt: skip
        with pytest.raises(SystemExit, match=words):
            render.render(argv)


# -- the pipelines ----------------------------------------------------------------------


def _selects(service: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_rank_zero_is_the_pod_the_http_service_selects(rendered):
    """c10d numbers the nodes by their sorted --local-addr: the leader's must sort first,
    and only the leader's pod may be behind the pipeline's HTTP Service."""
    argv, files = rendered
    sets = {s["metadata"]["name"]: s for s in _by_kind(files, "StatefulSet")}
    services = _by_kind(files, "Service")
    addresses: dict[str, list[tuple[str, str]]] = {}  # rendezvous id -> (address, role)
    for s in sets.values():
        args = _containers(s)[0]["args"]
        pods = [f"{s['metadata']['name']}-{i}" for i in range(s["spec"]["replicas"])]
        if "--standalone" in args:  # one node a pipeline: every pod is its own rank 0
            continue
        rdzv = args[args.index("--rdzv-id") + 1]
        local = args[args.index("--local-addr") + 1]
        role = s["spec"]["template"]["metadata"]["labels"]["wavepp-role"]
        addresses.setdefault(rdzv, []).extend(
            (local.replace("$(POD_NAME)", pod), role) for pod in pods)  # fmt: skip
        labels = s["spec"]["template"]["metadata"]["labels"]
        http = [v for v in services if _selects(v, labels)
                and any(p["name"] == "http" for p in v["spec"]["ports"])]  # fmt: skip
        assert len(http) == (role == "leader"), (s["metadata"]["name"], http)
    for rdzv, nodes in addresses.items():
        assert sorted(nodes)[0][1] == "leader", (rdzv, sorted(nodes))
        assert sum(role == "leader" for _, role in nodes) == 1
    nodes = int(argv[argv.index("--nodes") + 1]) if "--nodes" in argv else 2
    assert all(len(v) == nodes for v in addresses.values())


def test_the_probes_follow_health_through_start_up_and_drain(rendered):
    """Before the server listens /health refuses (start-up: the startup probe waits);
    while it drains it answers 503 (readiness fails at once, liveness only after longer
    than the drain, and the pod gets longer than the drain before SIGKILL)."""
    _, files = rendered
    drain = 25.0
    for doc, container in _all_containers(files):
        pod = doc["spec"]["template"]["spec"]
        ports = {p["name"] for p in container.get("ports", [])}
        if "http" not in ports:  # a pipeline's worker: no HTTP, rank 0 watches it
            assert not any(k.endswith("Probe") for k in container)
            continue
        ready = container["readinessProbe"]
        assert ready["httpGet"] == {"path": "/health", "port": "http"}
        live = container["livenessProbe"]
        if "httpGet" in live:
            assert live["httpGet"]["path"] == "/health"
            assert live["periodSeconds"] * live["failureThreshold"] > drain
            assert container["startupProbe"]["httpGet"]["path"] == "/health"
        else:  # the router: 503 while no replica is up yet must not restart it
            assert container["command"][-1] == "wavepp.route" and "tcpSocket" in live
        if container["name"] != "vllm":
            assert pod["terminationGracePeriodSeconds"] > drain + 2
    for doc, container in _all_containers(files):  # torchrun waits out the drain, kubelet it
        if container["command"] == ["torchrun"]:
            args = container["args"]
            shutdown = int(args[args.index("--shutdown-timeout") + 1])
            grace = doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert drain + 2 < shutdown < grace


def test_the_router_lists_every_pipeline_and_every_decoder(rendered):
    _, files = rendered
    (router,) = [c for _, c in _all_containers(files) if c["name"] == "router"]
    args = router["args"]
    replicas = [args[i + 1] for i, a in enumerate(args) if a == "--replica"]
    decoders = [args[i + 1] for i, a in enumerate(args) if a == "--decoder"]
    services = {s["metadata"]["name"] for s in _by_kind(files, "Service")}
    for url in replicas + decoders:
        host = re.fullmatch(r"http://([^:/]+):8000", url)[1]
        assert host.split(".")[-1] in services, url  # a Service, or a pod of a headless one
    sets = _by_kind(files, "StatefulSet")
    leaders = [s for s in sets if s["spec"]["template"]["metadata"]["labels"].get(
        "wavepp-role") == "leader"]  # fmt: skip
    hpa = _by_kind(files, "HorizontalPodAutoscaler")
    expected = hpa[0]["spec"]["maxReplicas"] if hpa else len(leaders)
    assert len(replicas) == len(set(replicas)) == expected
    decoder_sets = [d for d in _by_kind(files, "Deployment") if "decoder" in d["metadata"]["name"]]
    assert len(decoders) == len(decoder_sets)
    for service in _by_kind(files, "Service"):  # every pipeline Service exposes KV events
        if service["spec"]["selector"].get("wavepp-role") == "leader":
            ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
            assert ports.get("kv-events") == 5557 and ports.get("kv-replay") == 5558


def test_the_autoscaler_scales_the_pipelines_on_metrics_the_adapter_serves(rendered):
    _, files = rendered
    hpas = _by_kind(files, "HorizontalPodAutoscaler")
    if not hpas:
        assert "hpa.yaml" not in files
        return
    (hpa,) = hpas
    target = hpa["spec"]["scaleTargetRef"]
    assert target["kind"] == "StatefulSet"
    assert target["name"] in {s["metadata"]["name"] for s in _by_kind(files, "StatefulSet")}
    (adapter,) = _by_kind(files, "ConfigMap")
    served = {r["name"]["as"] for r in yaml.safe_load(adapter["data"]["config.yaml"])["rules"]}
    used = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert used == served == set(render.observability.AUTOSCALING_METRICS)


# -- the metrics ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, process: subprocess.Popen, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds  # a hang guard
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} did not answer 200 within {seconds:g} s")


SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                   "summary": ("", "_count", "_sum"), "gauge": ("",)}  # fmt: skip


def _declared(text: str) -> set[str]:
    """The sample names of every family an exposition declares, samples or not yet (a
    labelled counter shows none until its first label, as the router's retries)."""
    return {family.name + suffix for family in text_string_to_metric_families(text)
            for suffix in SAMPLE_SUFFIXES.get(family.type, ("",))}  # fmt: skip


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every sample name a running server (one stage, simulated, with KV events) and a
    router over it export, after a request with a deadline went through both."""
    server_port, router_port, events_port = _free_port(), _free_port(), _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "wavepp.serve", "--port", str(server_port), "--executor", "sim",
         "--model", "llama3-70b", "--kv-events", f"tcp://127.0.0.1:{events_port}"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    router = None
    try:
        _wait_for(f"http://127.0.0.1:{server_port}/health", server)
        router = subprocess.Popen(
            [sys.executable, "-m", "wavepp.route", "--port", str(router_port),
             "--replica", f"http://127.0.0.1:{server_port}"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        _wait_for(f"http://127.0.0.1:{router_port}/health", router)
        body = {"tokens": list(range(1, 200)), "deadline_s": 30}
        answer = httpx.post(f"http://127.0.0.1:{router_port}/v1/prefill", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        names = set()
        for port in (server_port, router_port):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            names |= {key.split("{")[0] for key in parse_exposition(text)}
            names |= _declared(text)
        return names
    finally:
        for process in (router, server):
            if process is not None:
                process.send_signal(signal.SIGTERM)
        for process in (router, server):
            if process is not None:
                try:
                    process.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.communicate()


METRIC = re.compile(r"\bwavepp_[a-z0-9_]+\b")


def _named_metrics() -> dict[str, set[str]]:
    """Where each metric is named: the dashboard's queries, prometheus.yml, and every
    adapter rule and HPA of every shape."""
    dashboard = json.loads((DEPLOY / "monitoring" / "grafana-dashboard.json").read_text())
    where = {"dashboard": {m for p in dashboard["panels"] for t in p["targets"]
                           for m in METRIC.findall(t["expr"])},
             "prometheus.yml": set(METRIC.findall(
                 (DEPLOY / "monitoring" / "prometheus.yml").read_text()))}  # fmt: skip
    for argv in SHAPES:
        files = render.render(list(argv))
        for name in ("hpa.yaml", "prometheus-adapter.yaml"):
            if name in files:
                where.setdefault(name, set()).update(METRIC.findall(files[name]))
    return where


@pytest.mark.slow
def test_every_metric_named_is_one_wavepp_exports(exported):
    where = _named_metrics()
    assert where["dashboard"] and where["hpa.yaml"]
    for place, names in where.items():
        missing = names - exported
        assert not missing, f"{place} names metrics no server or router exports: {missing}"
    wanted = {"wavepp_engine_stages_utilization", "wavepp_cached_tokens_total",
              "wavepp_queue_seconds_bucket", "wavepp_handoff_bytes_total",
              "wavepp_handoff_seconds_bucket", "wavepp_engine_slo_attainment",
              "wavepp_route_slo_attainment", "wavepp_drain_seconds"}  # fmt: skip
    assert wanted <= where["dashboard"]  # the figures that matter are on it


# -- the images and the commands --------------------------------------------------------


def test_the_images_install_pinned_versions():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    targets = re.findall(r"^FROM \S+ AS (\w+)$", dockerfile, re.M)
    assert {"cpu", "cuda"} <= set(targets)
    installs = re.findall(r"pip install ([^\n\\&]+)", dockerfile)
    wavepp = [i for i in installs if re.search(r"(^|\s)\"?\.(\[\w+\])?\"?\s*$", i)]
    assert len(wavepp) == 2 and all("-c constraints.txt" in i for i in wavepp), installs
    assert '".[cuda]"' in dockerfile
    torch = [i for i in installs if "torch==" in i]
    assert len(torch) == 2 and all("download.pytorch.org/whl/" in i for i in torch)
    pinned = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert all(f"torch=={pinned}" in i for i in torch)
    vllm = (DEPLOY / "Dockerfile.vllm").read_text()
    assert re.search(r"pip install --no-cache-dir -c /tmp/vllm-image.txt \.", vllm)


def _modules() -> dict[str, list[list[str]]]:
    """Every ``python -m X`` (and torchrun's ``-m X``) the images and manifests run:
    module -> the argument lists it is given (the manifests')."""
    modules: dict[str, list[list[str]]] = {}
    for name in ("Dockerfile", "Dockerfile.vllm"):
        for module in re.findall(r"python3? -m ([\w.]+)", (DEPLOY / name).read_text()):
            modules.setdefault(module, [])
    for argv in SHAPES:
        for _, container in _all_containers(render.render(list(argv))):
            line = container["command"] + container.get("args", [])
            if line[0] in ("python", "python3", "torchrun") and "-m" in line:
                i = line.index("-m")
                modules.setdefault(line[i + 1], []).append(line[i + 2:])
                if line[0] == "torchrun":
                    modules.setdefault("torch.distributed.run", []).append(line[1:])
    return modules


def test_every_command_run_is_a_real_module_answering_help():
    modules = _modules()
    assert {"wavepp.serve", "wavepp.route", "torch.distributed.run"} <= set(modules)
    for module in modules:
        done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, text=True,
                              capture_output=True, timeout=120)  # fmt: skip
        assert done.returncode == 0 and "usage" in done.stdout.lower(), (module, done.stderr)


def test_every_command_line_passes_its_programs_own_checks():
    from torch.distributed.run import get_args_parser

    from wavepp.route.__main__ import check as check_route
    from wavepp.route.__main__ import parser as route_parser
    from wavepp.serve.__main__ import check as check_serve

    modules = _modules()
    for argv in modules["torch.distributed.run"]:
        args = get_args_parser().parse_args(argv)
        assert args.module and args.training_script == "wavepp.serve"
    for argv in modules["wavepp.serve"]:
        check_serve(argv)
    for argv in modules["wavepp.route"]:
        check_route(route_parser().parse_args(argv))


def test_the_hpa_docs_fleet_shows_is_the_one_deploy_holds():
    fleet = (ROOT / "docs" / "fleet.md").read_text()
    section = fleet.split("### Autoscaling on Kubernetes", 1)[1]
    shown = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S)[1])
    assert [shown] == _by_kind(render.render(list(AUTOSCALED)), "HorizontalPodAutoscaler")
