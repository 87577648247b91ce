"""A verification step of draft trees (``speculative.tree``) in the model runner.

A request with ``n`` drafts of a :class:`~lmkit.spec_decode.tree.DraftTree` runs
``n + 1`` query rows: its last known token (the root) and the drafts in node order,
stored in consecutive cache slots as a chain would be, but each at position ``root +
depth`` and seeing only the context and its ancestors (:func:`mark_tree_rows`: the
attention metadata's tree region and mask bits). After verification
(:func:`lmkit.worker.step_sampling.sample_tree_step`,
:func:`lmkit.sample.tree_verify.verify_tree`)
:func:`compact_accepted` moves the accepted nodes' K/V, hidden states and the draft
head's features to the rows and slots of a chain, so everything after (committing the
tokens, the head's catch-up, prefix caching) sees the accepted tokens as if they had
been drafted in a chain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmkit.api.attention import MAX_TREE_REGION
from lmkit.api.kv_cache_spec import KVCacheGroup
from lmkit.api.spec_decode import RUNNER_HOSTED_FEATURES
from lmkit.errors import ConfigError, PluginError
from lmkit.platform import switched_off
from lmkit.spec_decode.tree import DraftTree, configured_tree

if TYPE_CHECKING:
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.resolve import ResolvedStack
    from lmkit.worker.input_batch import StepInputs
    from lmkit.worker.step_plan import SamplingPlan


def tree_of(config: LMKitConfig, stack: ResolvedStack) -> DraftTree | None:
    """The configured draft tree (``speculative.tree``), ``None`` for chains.

    Raises:
        ConfigError: a tree without a draft head (speculation off, or a proposer that
            drafts from token ids).
    """
    if not config.speculative.tree:
        return None
    reg = stack.get("speculative")
    if reg is None or not RUNNER_HOSTED_FEATURES & reg.spec.caps.features:
        raise ConfigError(
            "speculative.tree: draft trees are drafted by a draft head, but "
            + (f"proposer {reg.name!r} drafts from token ids" if reg else
               "speculation is off") + "; use --speculative eagle or eagle3 (with "
            "--speculative-model), or drop --spec-tree")
    return configured_tree(config.speculative)


def mark_tree_rows(step: StepInputs, order: Sequence[str], spec: Mapping[str, list[int]],
                   tree: DraftTree | None) -> StepInputs:
    """Give the step's draft rows their tree positions and attention masks (in place:
    ``step.positions``, ``step.tree_region``, ``step.tree_mask``) and return the step;
    a step without drafts (or ``tree`` ``None``) is left causal.

    A request's region is its whole query: the drafts' ``n + 1`` rows (root and nodes)
    and any rows a scheduler put before them (causal among themselves, seen by all).

    Raises:
        PluginError: a request's query with drafts is longer than
            :data:`~lmkit.api.MAX_TREE_REGION` rows (one int64 of mask bits per row).
    """
    if tree is None or not any(spec.get(r) for r in order):
        return step
    region = np.zeros(len(order), dtype=np.int32)
    mask = np.full(step.num_tokens, -1, dtype=np.int64)
    positions = step.positions.numpy()
    for i, rid in enumerate(order):
        n = len(spec.get(rid) or ())
        if not n:
            continue
        end, q = int(step.cu_num_tokens[i]), int(step.num_scheduled[i])
        if q > MAX_TREE_REGION:
            raise PluginError(f"request {rid}: {q} tokens scheduled with {n} tree drafts; "
                              f"a tree step takes at most {MAX_TREE_REGION} per request")
        pre, root = q - n - 1, end - n - 1  # the drafts are the request's last n rows
        region[i] = q
        mask[end - q:root] = (np.int64(2) << np.arange(pre, dtype=np.int64)) - 1  # causal
        mask[root:end] = (tree.masks[:n + 1] << pre) | ((np.int64(1) << pre) - 1)
        positions[root:end] = positions[root] + tree.depths[:n + 1]
    step.tree_region, step.tree_mask = region, mask
    return step


def compact_accepted(groups: Sequence[KVCacheGroup], kv_caches: Sequence[torch.Tensor],
                     step: StepInputs, plan: SamplingPlan, paths: Sequence[Sequence[int]],
                     features: Sequence[torch.Tensor]) -> None:
    """Move each request's accepted draft nodes to the rows and cache slots of a chain:
    the ``j``-th accepted node's K/V (every layer) to the slot of draft ``j``, its rows
    of ``features`` (the hidden states, the draft head's target-layer inputs) to that
    draft's row. Requests whose path is already a chain move nothing."""
    src_rows, dst_rows = [], []
    for (_, first_row, _), path in zip(plan, paths, strict=True):
        for j, node in enumerate(path, start=1):
            if node != j:
                src_rows.append(first_row + node)
                dst_rows.append(first_row + j)
    if not src_rows:
        return
    src, dst = np.asarray(src_rows), np.asarray(dst_rows)
    slots = step.slot_mapping.numpy()
    device = kv_caches[0].device
    src_slots, dst_slots = (torch.from_numpy(slots[r]).to(device) for r in (src, dst))
    for group in groups:
        for layer in group.layers:
            group.attn.copy_kv_slots(kv_caches[layer], src_slots, dst_slots)
    src_rows_t, dst_rows_t = (torch.from_numpy(r).to(device) for r in (src, dst))
    for rows in features:  # (on the model's device, as the caches)
        rows[dst_rows_t] = rows[src_rows_t]


def flattened_tree_rows(step: StepInputs) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The ``seq_lens`` of a draft-tree step's flattened rows (one past each token's slot
    index in its sequence) and their tree regions (a tree request's row ``o``: ``o + 1``,
    back to its first query row; other requests' rows 0) with the step's mask bits."""
    assert step.tree_region is not None and step.tree_mask is not None
    offsets = np.arange(step.num_tokens) - np.repeat(step.cu_num_tokens - step.num_scheduled,
                                                      step.num_scheduled)
    seq_lens = (np.repeat(step.num_computed, step.num_scheduled) + offsets + 1).astype(np.int32)
    treed = np.repeat(step.tree_region, step.num_scheduled) > 0
    return seq_lens, (np.where(treed, offsets + 1, 0).astype(np.int32), step.tree_mask)


def tree_graphs(config: LMKitConfig) -> bool:
    """Whether draft-tree verifications replay the decode CUDA graphs (flattened, with
    tree buffers): with a tree, unless ``LMKIT_TREE_GRAPHS=0`` (or ``off``; tree steps and the
    head's level passes then run eagerly: on an H200 at batch 1, 131 tok/s against 372)."""
    return bool(config.speculative.tree) and not switched_off("LMKIT_TREE_GRAPHS")
