"""Static draft trees: which draft tokens a runner-hosted head proposes per step, as a
tree verified in one target pass.

A tree is given as its nodes' *rank paths*: ``(0,)`` is the head's top draft after the
last known token, ``(1,)`` its second best, ``(0, 2)`` the third best draft after
``(0,)``, and so on (the format of vLLM's ``speculative_token_tree``). A chain of ``k``
drafts is ``(0,), (0, 0), ...``. Nodes are kept in breadth-first order (by depth, then
path), so every parent comes before its children and any prefix of the nodes is a tree:
a request with room for fewer drafts takes the first ones.

Node 0 is the root, the request's last known token; node ``i >= 1`` is draft ``i``. In a
verification step the request's query rows are the root and its drafts in that order,
written to consecutive cache slots, each at position ``root + depth``; each row sees
the context and its ancestors (:attr:`DraftTree.masks`). Verification walks from the
root to the deepest accepted node (:mod:`lmkit.sample.tree_verify`); the runner then
moves the accepted nodes' K/V to the slots of a chain.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from lmkit.errors import ConfigError

#: most draft nodes in a tree: the root and the drafts fit one int64 of mask bits
MAX_TREE_NODES = 63


@dataclass(frozen=True)
class DraftTree:
    """A static draft tree; build it with :meth:`from_paths` or :meth:`parse`.

    Attributes:
        paths: the drafts' rank paths in breadth-first order (node ``i`` is
            ``paths[i - 1]``).
        parents: int64 ``[num_nodes + 1]``, each node's parent (-1 for the root).
        depths: int64 ``[num_nodes + 1]`` (the root 0).
        ranks: int64 ``[num_nodes + 1]``, each draft's rank among the head's drafts
            after its parent (the root 0).
        masks: int64 ``[num_nodes + 1]``, bit ``j`` of ``masks[i]`` set when node ``j``
            is node ``i`` or one of its ancestors.
        children: per node, its ``(rank, child)`` pairs by rank.
    """

    paths: tuple[tuple[int, ...], ...]
    parents: np.ndarray = field(repr=False)
    depths: np.ndarray = field(repr=False)
    ranks: np.ndarray = field(repr=False)
    masks: np.ndarray = field(repr=False)
    children: tuple[tuple[tuple[int, int], ...], ...] = field(repr=False, default=())

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> DraftTree:
        """The tree of these rank paths (any order).

        Raises:
            ConfigError: an empty tree, more than :data:`MAX_TREE_NODES` nodes, a path
                that is empty, repeated, has a negative or non-integer rank, or whose
                parent path is missing.
        """
        if not paths:
            raise ConfigError("speculative.tree: the draft tree has no nodes; give rank "
                              "paths such as [[0], [1], [0, 0]]")
        seen: set[tuple[int, ...]] = set()
        for raw in paths:
            if (not isinstance(raw, (list, tuple)) or not raw
                    or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                               for r in raw)):
                raise ConfigError(f"speculative.tree: node {raw!r} is not a rank path (a "
                                  "non-empty list of ranks >= 0, e.g. [0, 1])")
            path = tuple(raw)
            if path in seen:
                raise ConfigError(f"speculative.tree: node {list(path)} is given twice")
            seen.add(path)
        for path in seen:
            if len(path) > 1 and path[:-1] not in seen:
                raise ConfigError(f"speculative.tree: node {list(path)} has no parent "
                                  f"{list(path[:-1])} in the tree")
        if len(seen) > MAX_TREE_NODES:
            raise ConfigError(f"speculative.tree: {len(seen)} nodes; at most "
                              f"{MAX_TREE_NODES} drafts per step")
        ordered = tuple(sorted(seen, key=lambda p: (len(p), p)))
        index = {p: i + 1 for i, p in enumerate(ordered)}
        n = len(ordered) + 1
        parents = np.full(n, -1, dtype=np.int64)
        depths = np.zeros(n, dtype=np.int64)
        ranks = np.zeros(n, dtype=np.int64)
        masks = np.zeros(n, dtype=np.int64)
        masks[0] = 1
        kids: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for p, i in index.items():
            parents[i] = index.get(p[:-1], 0)
            depths[i], ranks[i] = len(p), p[-1]
            masks[i] = masks[parents[i]] | _bit(i)
            kids[parents[i]].append((p[-1], i))
        return cls(ordered, parents, depths, ranks, masks,
                   tuple(tuple(sorted(k)) for k in kids))

    @classmethod
    def parse(cls, value: str | Sequence[Sequence[int]]) -> DraftTree:
        """A tree from its rank paths, their JSON text (``"[[0], [1], [0, 0]]"``) or the
        path of a file holding that text (as ``lmkit spec fit-tree --out`` writes it).

        Raises:
            ConfigError: the text is neither JSON nor a readable file, or the paths do
                not make a tree.
        """
        if isinstance(value, str):
            text = value
            if not value.lstrip().startswith("[") and Path(value).is_file():
                try:
                    text = Path(value).read_text()
                except (OSError, UnicodeDecodeError) as e:
                    raise ConfigError(f"speculative.tree: cannot read {value} ({e})") from None
            try:
                value = json.loads(text)
            except ValueError as e:
                raise ConfigError(f"speculative.tree: {value!r} is neither JSON ({e}) nor a "
                                  "file; give rank paths such as [[0], [1], [0, 0]]") from None
            if not isinstance(value, list):
                raise ConfigError("speculative.tree: expected a JSON list of rank paths, "
                                  f"got {type(value).__name__}")
        return cls.from_paths(value)

    @property
    def num_nodes(self) -> int:
        """Draft tokens per step (the root not counted)."""
        return len(self.paths)

    @cached_property
    def widest_parent_level(self) -> int:
        """The most nodes with children at one depth (the rows per request of a draft
        head's widest level pass)."""
        return max(map(len, self.parent_levels))

    @cached_property
    def rank_width(self) -> int:
        """Drafts a head ranks after each node it expands: one more than the highest rank
        of any node."""
        return 1 + int(self.ranks[1:].max())

    @cached_property
    def first_child(self) -> np.ndarray:
        """int64 ``[num_nodes + 1]``: each node's first child in node order
        (``num_nodes + 1`` for a leaf): a request with room for ``n`` drafts expands the
        nodes whose first child is at most ``n``."""
        first = np.full(self.num_nodes + 1, self.num_nodes + 1, dtype=np.int64)
        np.minimum.at(first, self.parents[1:], np.arange(1, self.num_nodes + 1))
        return first

    @cached_property
    def parent_levels(self) -> tuple[np.ndarray, ...]:
        """Per depth ``d`` from 0, the nodes of depth ``d`` with children, ascending (the
        root alone at depth 0): a head expands level ``d`` in one pass."""
        parents = np.unique(self.parents[1:])
        return tuple(parents[self.depths[parents] == d]
                     for d in range(int(self.depths[parents].max()) + 1))

    @property
    def num_levels(self) -> int:
        """Head passes that draft a whole tree after the root's ranks (its depth - 1)."""
        return len(self.parent_levels) - 1

    def child_ranks(self, node: int, num_nodes: int | None = None) -> list[tuple[int, int]]:
        """``(rank, child)`` of ``node``'s children among the first ``num_nodes``
        drafts, by rank."""
        n = self.num_nodes if num_nodes is None else num_nodes
        return [(r, c) for r, c in self.children[node] if c <= n]

    def path_to(self, node: int) -> list[int]:
        """The drafts from the root's first child to ``node`` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]


def configured_tree(speculative: Any) -> DraftTree | None:
    """The draft tree of a config's ``speculative`` section (its validated ``tree``),
    ``None`` when it drafts chains."""
    return DraftTree.from_paths(speculative.tree) if speculative.tree else None


def tree_paths(value: Any) -> list[list[int]]:
    """A config value (rank paths or their JSON text) as the tree's paths in
    breadth-first order.

    Raises:
        ValueError: it is not a tree (the message without the ``speculative.tree`` prefix,
            which the config's error adds).
    """
    try:
        return [list(p) for p in DraftTree.parse(value).paths]
    except ConfigError as e:
        raise ValueError(str(e).removeprefix("speculative.tree: ")) from None


def _bit(i: int) -> np.int64:
    """Bit ``i`` of an int64 (bit 63 is the sign bit)."""
    return np.int64(np.uint64(1 << i).view(np.int64))
