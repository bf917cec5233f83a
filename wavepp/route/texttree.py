"""An approximate radix tree of the prompts routed to one replica (the ``text-tree`` baseline).

SGLang's gateway keeps one such tree per worker over request text: it inserts each prompt
into the tree of the worker it chose and evicts least recently used leaves past a size
bound. It is a guess — the worker may have evicted the prefix, computed only part of it,
or (on a pipeline) hold it on some stages only — which is what the ``prefix`` policy's
event-fed index does not guess. Here the keys are token ids (or a text prompt's code
points).
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_MAX_TOKENS = 1 << 22  # tokens a tree holds before it evicts (SGLang: max_tree_size)


class _Node:
    __slots__ = ("children", "edge", "last_used", "parent")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None, last_used: int) -> None:
        self.edge = edge  # the tokens on the edge from the parent to this node
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first token of the child's edge -> child
        self.last_used = last_used  # the tree's insert count when a prompt last passed here


def _common(edge: tuple[int, ...], key: Sequence[int], start: int) -> int:
    n = min(len(edge), len(key) - start)
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i


class TextTree:
    """Prompts inserted so far (bounded by ``max_tokens``, LRU leaves evicted first)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be ≥ 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.num_tokens = 0  # tokens on all edges
        self._root = _Node((), None, 0)
        self._clock = 0

    def match(self, key: Sequence[int]) -> int:
        """Tokens of ``key``'s longest prefix in the tree. Changes nothing."""
        node, depth = self._root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                break
            same = _common(child.edge, key, depth)
            depth += same
            if same < len(child.edge):
                break
            node = child
        return depth

    def insert(self, key: Sequence[int]) -> None:
        """Add ``key`` (its path becomes the most recently used), then evict past the bound."""
        self._clock += 1
        node, depth = self._root, 0
        while depth < len(key):
            node.last_used = self._clock
            child = node.children.get(key[depth])
            if child is None:
                leaf = _Node(tuple(key[depth:]), node, self._clock)
                node.children[key[depth]] = leaf
                self.num_tokens += len(leaf.edge)
                node = leaf
                break
            same = _common(child.edge, key, depth)
            if same < len(child.edge):  # split the edge where the key leaves it
                middle = _Node(child.edge[:same], node, self._clock)
                node.children[key[depth]] = middle
                child.edge = child.edge[same:]
                child.parent = middle
                middle.children[child.edge[0]] = child
                child = middle
            depth += same
            node = child
        node.last_used = self._clock
        if self.num_tokens > self.max_tokens:
            self._evict(self.max_tokens * 9 // 10)

    def _evict(self, target: int) -> None:
        """Remove least recently used leaves until at most ``target`` tokens remain."""
        while self.num_tokens > target:
            leaves, stack = [], [self._root]
            while stack:
                node = stack.pop()
                if node.children:
                    stack.extend(node.children.values())
                elif node is not self._root:
                    leaves.append(node)
            leaves.sort(key=lambda n: n.last_used)
            for leaf in leaves:
                if self.num_tokens <= target:
                    return
                parent = leaf.parent
                assert parent is not None
                del parent.children[leaf.edge[0]]
                self.num_tokens -= len(leaf.edge)
