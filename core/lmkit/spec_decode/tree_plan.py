"""Where each row of a draft head's tree drafting comes from: the plan of one step's
level passes, built on the host from the tree and each request's room for drafts,
before any draft is known.

A request drafts its first ``n`` nodes (a prefix of breadth-first order is a tree).
Level 0 is the requests' roots: the head's output at each last kept position ranks the
root's children. Level ``d >= 1`` is one head pass over the depth-``d`` nodes that have
a drafted child: each row reads its own token, which the level before ranked, and its
parent's output. Every level ranks the head's top :attr:`~lmkit.spec_decode.tree.
DraftTree.rank_width` drafts after each of its rows, so a row's token is the entry
``parent_row * width + rank`` of the level before's ranks, flattened; the drafts of a
request are gathered the same way at the end. None of these indices depends on the
drafted tokens, so the passes can run one after the other on the device without the
host reading anything back in between (:mod:`lmkit.worker.tree_drafts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lmkit.spec_decode.tree import DraftTree


@dataclass(frozen=True)
class LevelRows:
    """The rows of one level pass (depth ``d >= 1``), grouped by request, in node order.

    Attributes:
        req: each row's request, an index into :attr:`TreePlan.roots`.
        node: the node the row runs (its token's; it ranks the node's children).
        parent: the row of the node's parent in the level before (level 1: the root
            rows, i.e. :attr:`TreePlan.roots` order).
        src: ``parent * width + rank``: the row's token in the level before's ranks.
    """

    req: np.ndarray
    node: np.ndarray
    parent: np.ndarray
    src: np.ndarray


@dataclass(frozen=True)
class TreePlan:
    """One step's tree drafting: its roots, its level passes and where each draft is.

    Attributes:
        roots: the requests with room for at least one draft (indices into the drafting
            requests), the rows of level 0.
        counts: drafts per root (its first ``counts[i]`` nodes).
        width: drafts ranked after each row (the tree's rank width).
        levels: the level passes ``1..``; a level without rows ends the list.
        draft_level, draft_row, draft_rank: per draft (root by root, in node order), the
            level of its parent, its parent's row in that level and its rank.
    """

    roots: np.ndarray
    counts: np.ndarray
    width: int
    levels: tuple[LevelRows, ...]
    draft_level: np.ndarray
    draft_row: np.ndarray
    draft_rank: np.ndarray

    @property
    def max_rows(self) -> int:
        """The most rows of one level pass (0 without level passes)."""
        return max((len(level.node) for level in self.levels), default=0)


def plan_tree(tree: DraftTree, num_drafts: np.ndarray) -> TreePlan:
    """The plan of drafting ``tree`` for requests with room for ``num_drafts`` drafts each
    (at most ``tree.num_nodes``; 0: the request drafts nothing)."""
    n = np.minimum(np.asarray(num_drafts, dtype=np.int64), tree.num_nodes)
    roots = np.flatnonzero(n > 0)
    room = n[roots][:, None]
    width = tree.rank_width
    # a node's row in its level, per root (-1: not run); the roots are level 0
    row_of = np.full((len(roots), tree.num_nodes + 1), -1, dtype=np.int64)
    row_of[:, 0] = np.arange(len(roots))
    levels = []
    for nodes in tree.parent_levels[1:]:  # the nodes of depth d with children
        runs = tree.first_child[nodes][None, :] <= room  # a drafted child
        req, col = np.nonzero(runs)  # request-major, then node order
        if not len(req):
            break
        node = nodes[col]
        row_of[req, node] = np.arange(len(req))
        parent = row_of[req, tree.parents[node]]
        levels.append(LevelRows(req, node, parent, parent * width + tree.ranks[node]))
    req, col = np.nonzero(np.arange(1, tree.num_nodes + 1)[None, :] <= room)
    node = col + 1
    parent = tree.parents[node]
    return TreePlan(roots, n[roots], width, tuple(levels), tree.depths[parent],
                    row_of[req, parent], tree.ranks[node])
