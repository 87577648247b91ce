"""A draft head's tree drafts (``speculative.tree``), level by level.

After the catch-up pass the head's output at a request's last kept position drafts the
root's children: the head's top-ranked tokens there (:meth:`~lmkit.api.RunnerProposer.
draft_logits`, ranks as the tree's rank paths name them). Each further level is one
head pass over the nodes that have children, all requests together: node ``c`` of
depth ``d`` reads its own token and its parent's output, sits at position ``last + d``
and writes its K/V at sequence index ``last + c`` (the slot a chain's draft ``c`` would
take), and attends to the context and to its ancestors only (the tree region of the
attention metadata, :mod:`lmkit.worker.tree_step`). Its output drafts its children.

Drafts are the head's argmax-ranked tokens, deterministic drafts for verification
(:mod:`lmkit.sample.tree_verify`); a grammar's mask rows follow each node's path
(:func:`lmkit.structured.rows.fill_tree_rows`). Which rows a level runs and where each
row's token and features come from is known before any draft
(:func:`lmkit.spec_decode.tree_plan.plan_tree`), so the levels run one after the other
on the device, each gathering from the one before, and the host reads the drafts back
once, at the end. When the target's decode graphs take trees (the default with a tree;
``LMKIT_TREE_GRAPHS=0`` turns them off) all of a step's level passes replay as one
chained graph (:func:`level_pass_graphs`), flattened: node ``c`` a decode row with
``seq_len = last + c + 1``, a region of its ``c`` drafts before it and its ancestors'
mask bits; otherwise each level is one eager pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmkit.spec_decode.tree_plan import LevelRows, TreePlan, plan_tree
from lmkit.worker.draft_graphs import maybe_capture_passes, ranked_drafts

if TYPE_CHECKING:
    from lmkit.spec_decode.tree import DraftTree
    from lmkit.worker.cuda_graphs import CudaGraphRunner
    from lmkit.worker.draft_graphs import DraftPassGraphs
    from lmkit.worker.draft_runner import DraftRunner


def draft_tree(drafter: DraftRunner, tree: DraftTree, feat: torch.Tensor, last: np.ndarray,
               num_drafts: np.ndarray, req_rows: np.ndarray, tables: np.ndarray,
               step_index: Sequence[int]) -> dict[int, list[int]]:
    """The draft trees of the drafting requests.

    Args:
        drafter: the draft runner (its head, KV caches, staging, request states).
        tree: the tree; a request drafts its first ``num_drafts`` nodes.
        feat: ``[n, hidden]``, the head's output at each request's last kept position.
        last: each request's last kept position (the root's).
        num_drafts: nodes each request has room for (its blocks, the context limit).
        req_rows: the requests' batch rows (not needed here: for a caller wrapping this
            function to tell the requests apart); ``tables``: their block tables.
        step_index: the requests' indices in the step.

    Returns:
        step index -> the drafts' tokens in node order.
    """
    plan = plan_tree(tree, num_drafts)
    roots = plan.roots
    if not len(roots):
        return {}
    if len(roots) < len(feat):
        feat = feat.index_select(0, drafter.staging.put(roots))
    last, tables = last[roots], tables[roots]
    ranks = [ranked_drafts(drafter.proposer, feat, plan.width)]  # level 0: the roots' ranked drafts
    draft_row = plan.draft_row
    graphs = drafter.graphs
    if (plan.levels and graphs is not None and graphs.runner.tree
            and graphs.chain == tree.num_levels
            and len(roots) * tree.widest_parent_level <= graphs.max_rows
            and tables.shape[1] <= graphs.max_blocks):
        ranked, placed = _replayed_levels(drafter, graphs, tree, plan, feat, ranks[0], last,
                                          tables)
        ranks.extend(ranked)
        draft_row = draft_row.copy()  # a level's rows where the replay placed them
        for j, at in enumerate(placed, start=1):
            sel = plan.draft_level == j
            draft_row[sel] = at[draft_row[sel]]
    elif plan.levels:
        gathers = drafter.staging.put(np.concatenate(
            [np.stack([level.src, level.parent]) for level in plan.levels], axis=1))
        out, done = feat, 0
        for level in plan.levels:
            m = len(level.node)
            ids = ranks[-1].reshape(-1).index_select(0, gathers[0, done:done + m])
            parent_feat = out.index_select(0, gathers[1, done:done + m])
            done += m
            out = _level_pass(drafter, tree, parent_feat, ids, level, last, tables)
            ranks.append(ranked_drafts(drafter.proposer, out, plan.width))
    # each draft's place in the levels' ranks laid out flat: one gather, one copy back
    base = np.cumsum([0] + [len(r) * plan.width for r in ranks[:-1]])
    index = base[plan.draft_level] + draft_row * plan.width + plan.draft_rank
    flat = torch.cat([r.reshape(-1) for r in ranks])
    tokens = flat.index_select(0, drafter.staging.put(index)).cpu().numpy()
    ends = np.cumsum(plan.counts)
    return {int(step_index[int(r)]): tokens[end - count:end].tolist()
            for r, count, end in zip(roots, plan.counts, ends, strict=True)}


def level_pass_graphs(drafter: DraftRunner, tree: DraftTree,
                      target_graphs: CudaGraphRunner | None, max_num_seqs: int,
                      dtype: torch.dtype) -> DraftPassGraphs | None:
    """The captured level passes of ``tree`` for ``drafter``'s head, all of a step's in
    one replay (up to ``max_num_seqs`` requests, each with the rows of the tree's widest
    level), when the target's decode graphs take trees; else ``None``: the passes run
    eagerly, one by one."""
    if target_graphs is None or not target_graphs.tree or not tree.num_levels:
        return None
    return maybe_capture_passes(
        drafter.proposer, drafter.kv_caches, target_graphs, drafter.proposer.hidden_size,
        dtype, max_num_seqs * tree.widest_parent_level, drafter.max_model_len,
        drafter.block_size, chain=tree.num_levels, tree=True, ranks=tree.rank_width)


def _replayed_levels(drafter: DraftRunner, graphs: DraftPassGraphs, tree: DraftTree,
                     plan: TreePlan, feat: torch.Tensor, root_ranks: torch.Tensor,
                     last: np.ndarray, tables: np.ndarray
                     ) -> tuple[torch.Tensor, list[np.ndarray]]:
    """Every level pass of ``plan`` in one replay of the chained level graphs. Request
    ``r``'s rows of every level sit at ``r * w ..`` (``w``: the tree's widest level), so a
    graph row keeps one block-table row through the levels; the other rows pad. The
    first level's ids and features are gathered here, the later levels' in the graph
    (:meth:`~lmkit.worker.draft_graphs.HeadPass.before_pass`). Returns the levels'
    ranks, ``[levels, rows, width]``, and per level of ``plan`` the graph row of each of
    its rows."""
    w, width = tree.widest_parent_level, plan.width
    n = len(plan.roots) * w
    # [levels, field, n]: position, slot, seq_len, region, mask bits, id and feature gathers
    rows = np.zeros((tree.num_levels, 7, n), dtype=np.int64)
    rows[:, 1] = -1  # padding: no cache slot (and no context: seq_len 0)
    placed: list[np.ndarray] = []
    before = np.arange(len(plan.roots))  # the rows of the level before (the roots')
    for j, level in enumerate(plan.levels):
        at = level.req * w + np.arange(len(level.req)) - np.searchsorted(level.req, level.req)
        positions, index, slots = _placed(drafter, tree, level, last, tables)
        parent = before[level.parent]
        rows[j][:, at] = (positions, slots, index + 1, level.node, tree.masks[level.node] >> 1,
                          parent * width + tree.ranks[level.node], parent)
        placed.append(at)
        before = at
    put = drafter.staging.put
    first_ids = root_ranks.reshape(-1).index_select(0, put(rows[0, 5]))
    graphs.run(first_ids, feat.index_select(0, put(rows[0, 6])), rows[0, 0], rows[0, 1],
               np.repeat(tables, w, axis=0),
               chain_rows=rows[1:] if tree.num_levels > 1 else None,
               seq_lens=rows[0, 2].astype(np.int32),
               tree=(rows[0, 3].astype(np.int32), rows[0, 4]))
    return graphs.ranked(n), placed


def _level_pass(drafter: DraftRunner, tree: DraftTree, feat: torch.Tensor, ids: torch.Tensor,
                level: LevelRows, last: np.ndarray, tables: np.ndarray) -> torch.Tensor:
    """One eager head pass over a level's rows (grouped by request), fed ``ids`` and their
    parents' outputs ``feat``: a query of the request's nodes per request, each seeing
    the context and its ancestors; returns their outputs."""
    positions, _, slots = _placed(drafter, tree, level, last, tables)
    reqs, counts = np.unique(level.req, return_counts=True)  # (grouped: keeps the order)
    widest = np.maximum.reduceat(level.node, np.cumsum(counts) - counts)  # region's end
    return drafter.run_pass(ids, positions, slots, feat, np.cumsum(counts),
                            last[reqs] + 1 + widest, tables[reqs],
                            tree=(widest, tree.masks[level.node] >> 1))


def _placed(drafter: DraftRunner, tree: DraftTree, level: LevelRows, last: np.ndarray,
            tables: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A level's rows' positions (the root's plus the node's depth), the sequence index
    each node's K/V is written at (the root's plus the node: a chain's slot for draft
    ``node``) and that index's cache slot."""
    bs = drafter.block_size
    index = last[level.req] + level.node
    slots = tables[level.req, index // bs].astype(np.int64) * bs + index % bs
    return last[level.req] + tree.depths[level.node], index, slots
