"""The plan of a step's tree drafting (:func:`lmkit.spec_decode.tree_plan.plan_tree`)
against the level-by-level walk it replaces: the same rows per level, grouped by request
in node order, and every draft gathered from the ranks of its parent's row."""

from __future__ import annotations

import numpy as np
import pytest
from lmkit.spec_decode.tree import DraftTree
from lmkit.spec_decode.tree_plan import plan_tree

TREES = {
    "chain": [[0], [0, 0], [0, 0, 0]],
    "flat": [[0], [1], [2]],
    "fit16": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0],
              [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 0, 0, 0],
              [0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0]],
    "wide": [[0], [3], [0, 0], [0, 2], [3, 1], [0, 2, 0], [3, 1, 4]],
}


def walk(tree: DraftTree, num_drafts: np.ndarray, rank_of) -> tuple[list, dict]:
    """The level-by-level walk: per level, its ``(request, node)`` rows; per request,
    its drafts, ``rank_of(request, node, rank)`` being the head's draft of that rank
    after that node."""
    levels, drafts = [], {}
    cur = [(int(r), 0) for r in np.flatnonzero(num_drafts)]
    while cur:
        nxt = []
        for r, c in cur:
            for rank, child in tree.child_ranks(c, int(num_drafts[r])):
                drafts.setdefault(r, {})[child] = rank_of(r, c, rank)
                if tree.child_ranks(child, int(num_drafts[r])):
                    nxt.append((r, child))
        if nxt:
            levels.append(nxt)
        cur = nxt
    return levels, {r: [d[c] for c in sorted(d)] for r, d in drafts.items()}


@pytest.mark.parametrize("name", TREES)
def test_the_plan_is_the_walk(name):
    tree = DraftTree.from_paths(TREES[name])
    rng = np.random.default_rng(0)
    for _ in range(20):
        num_drafts = rng.integers(0, tree.num_nodes + 3, size=int(rng.integers(1, 6)))
        plan = plan_tree(tree, num_drafts)
        levels, drafts = walk(tree, np.minimum(num_drafts, tree.num_nodes),
                              lambda r, c, k: 1000 * r + 10 * c + k)
        roots = plan.roots
        assert roots.tolist() == np.flatnonzero(num_drafts).tolist()
        assert [list(zip(roots[lv.req].tolist(), lv.node.tolist(), strict=True))
                for lv in plan.levels] == levels
        # each level's ranks, computed for its rows; the drafts gathered by the plan
        rows = [[(int(r), 0) for r in roots]] + levels
        ranks = [np.array([[1000 * r + 10 * c + k for k in range(plan.width)]
                           for r, c in level]).reshape(-1) for level in rows]
        for lv, before in zip(plan.levels, ranks, strict=False):  # a row's own token
            assert before[lv.src].tolist() == [
                1000 * roots[r] + 10 * tree.parents[c] + tree.ranks[c]
                for r, c in zip(lv.req, lv.node, strict=True)]
        base = np.cumsum([0] + [len(r) for r in ranks[:-1]])
        flat = np.concatenate(ranks)
        got = flat[base[plan.draft_level] + plan.draft_row * plan.width + plan.draft_rank]
        ends = np.cumsum(plan.counts)
        assert {int(r): got[e - n:e].tolist() for r, n, e in
                zip(roots, plan.counts, ends, strict=True)} == drafts


def test_a_rows_token_is_its_parents_rank():
    """Level ``d``'s row of node ``c`` reads, at ``src``, the level before's rank of
    ``c`` after its parent's row, and its features at ``parent``."""
    tree = DraftTree.from_paths(TREES["wide"])
    plan = plan_tree(tree, np.array([7, 3, 0, 6]))
    rows = [list(zip(plan.roots.tolist(), [0] * len(plan.roots), strict=True))]
    for lv in plan.levels:
        before = rows[-1]
        for i, (r, c) in enumerate(zip(plan.roots[lv.req], lv.node, strict=True)):
            assert before[lv.parent[i]] == (r, tree.parents[c])
            assert lv.src[i] == lv.parent[i] * plan.width + tree.ranks[c]
        rows.append(list(zip(plan.roots[lv.req].tolist(), lv.node.tolist(), strict=True)))
    assert plan.width == 5 and tree.num_levels == 2 and plan.max_rows == 5


def test_tree_shape_facts():
    tree = DraftTree.from_paths(TREES["fit16"])
    assert tree.rank_width == 3 and tree.num_levels == 5 and tree.widest_parent_level == 3
    assert [p.tolist() for p in tree.parent_levels] == [[0], [1, 2], [4, 5, 6], [7, 8], [11],
                                                        [14]]
    assert tree.first_child[[0, 1, 2, 3, 16]].tolist() == [1, 4, 6, 17, 17]
    flat = DraftTree.from_paths(TREES["flat"])
    assert flat.num_levels == 0 and plan_tree(flat, np.array([3])).levels == ()
