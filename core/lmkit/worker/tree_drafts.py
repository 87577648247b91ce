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
(:func:`lmkit.structured.rows.fill_tree_rows`). One device-to-host copy of the
ranked tokens per level. The passes run eagerly, or, when the target's decode graphs
take trees (``LMKIT_TREE_GRAPHS=1``), replay the head's level-pass graphs
(:func:`level_pass_graphs`) flattened: node ``c`` a decode row with ``seq_len = last +
c + 1``, a region of its ``c`` drafts before it and its ancestors' mask bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmkit.worker.draft_graphs import maybe_capture_passes

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
        req_rows: the requests' batch rows; ``tables`` their block tables.
        step_index: the requests' indices in the step.

    Returns:
        step index -> the drafts' tokens in node order.
    """
    n = num_drafts.astype(np.int64)
    tokens = np.zeros((len(n), tree.num_nodes + 1), dtype=np.int64)
    cur_req = np.flatnonzero(n > 0)
    cur_node = np.zeros(len(cur_req), dtype=np.int64)
    cur_feat = feat.index_select(0, drafter.staging.put(cur_req)) if len(cur_req) else feat
    while len(cur_req):
        kids = [tree.child_ranks(int(c), int(n[r])) for r, c in zip(cur_req, cur_node,
                                                                       strict=True)]
        top = _ranked(drafter, cur_feat, 1 + max(rank for k in kids for rank, _ in k))
        nxt_req, nxt_node, parent = [], [], []
        for m, (r, children) in enumerate(zip(cur_req, kids, strict=True)):
            for rank, c in children:
                tokens[r, c] = top[m, rank]
                if tree.child_ranks(c, int(n[r])):  # it drafts children of its own
                    nxt_req.append(r)
                    nxt_node.append(c)
                    parent.append(m)
        if not nxt_req:
            break
        cur_req, cur_node = np.asarray(nxt_req), np.asarray(nxt_node)
        parent_feat = cur_feat.index_select(0, drafter.staging.put(np.asarray(parent)))
        cur_feat = _level_pass(drafter, tree, parent_feat, tokens[cur_req, cur_node], cur_req,
                               cur_node, last, req_rows, tables)
    return {int(step_index[int(r)]): tokens[r, 1:n[r] + 1].tolist() for r in np.flatnonzero(n)}


def _ranked(drafter: DraftRunner, feat: torch.Tensor, width: int) -> np.ndarray:
    """``[n, width]`` target ids: the head's top ``width`` drafts after each row of
    ``feat`` (its output features), best first."""
    logits, target_ids = drafter.proposer.draft_logits(feat)
    top = logits.topk(min(width, logits.shape[-1]), dim=-1).indices
    if target_ids is not None:
        top = target_ids[top]
    return top.cpu().numpy()


def level_pass_graphs(drafter: DraftRunner, tree: DraftTree,
                      target_graphs: CudaGraphRunner | None, max_num_seqs: int,
                      dtype: torch.dtype) -> DraftPassGraphs | None:
    """Captured level passes of ``tree`` for ``drafter``'s head (up to ``max_num_seqs``
    requests at its widest level), when the target's decode graphs take trees; else
    ``None``: the passes run eagerly."""
    if target_graphs is None or not target_graphs.tree:
        return None
    return maybe_capture_passes(
        drafter.proposer, drafter.kv_caches, target_graphs, drafter.proposer.hidden_size,
        dtype, max_num_seqs * tree.widest_parent_level, drafter.max_model_len,
        drafter.block_size, tree=True)


def _level_pass(drafter: DraftRunner, tree: DraftTree, feat: torch.Tensor, ids: np.ndarray,
                req: np.ndarray, node: np.ndarray, last: np.ndarray, req_rows: np.ndarray,
                tables: np.ndarray) -> torch.Tensor:
    """One head pass over the nodes ``node`` of requests ``req`` (grouped by request,
    in order), fed ``ids`` and their parents' outputs ``feat``; returns their outputs."""
    bs = drafter.block_size
    index = last[req] + node  # the sequence index each node's K/V is written at
    blocks = tables[req, index // bs].astype(np.int64)
    slots = blocks * bs + index % bs
    positions = last[req] + tree.depths[node]
    graphs = drafter.graphs
    if (graphs is not None and graphs.runner.tree and len(req) <= graphs.max_rows
            and tables.shape[1] <= graphs.max_blocks):  # flattened: a decode row per node
        return graphs.run(ids, feat, positions, slots, tables[req],
                          seq_lens=(index + 1).astype(np.int32),
                          tree=(node.astype(np.int32), tree.masks[node] >> 1))
    reqs, counts = np.unique(req, return_counts=True)  # (grouped: unique keeps the order)
    widest = np.maximum.reduceat(node, np.cumsum(counts) - counts)  # the region's end
    return drafter.run_pass(ids, positions, slots, feat, np.cumsum(counts),
                            last[reqs] + 1 + widest, tables[reqs],
                            tree=(widest, tree.masks[node] >> 1))
