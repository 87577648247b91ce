"""Short steps through the decode CUDA graphs, flattened: one decode row per token.

A step of a few tokens that is not a pure decode -- a short prompt's prefill, a small
mixed step -- would run through the piecewise graphs
(:mod:`lmkit.worker.piecewise_graphs`), which replay the forward between attention calls
and run each layer's attention eagerly: a Python call, its checks and a Triton launch
per layer, more host time than the whole step's GPU work at such sizes (SmolLM2-135M on
an H200: a 20-token prefill took 7 ms, a decode step 0.7 ms). Instead the step replays
the decode graphs *flattened*, as speculative verification does
(:mod:`lmkit.worker.cuda_graphs`): token ``t`` at position ``p`` becomes a decode row
with ``seq_len = p + 1`` over its request's block table, exact because every layer
writes the K/V of all the step's tokens before it attends. ``executor.
flat_step_max_tokens`` (default 64; 0 turns it off) bounds the step's tokens, and the
decode graphs are captured up to that size whatever ``scheduler.max_num_seqs``.

Each flattened row reads its request's whole prefix, where a prefill kernel reads it
once per query tile: after a long cached prefix that costs more than it saves, so a
step is flattened only while the rows of its multi-token requests read at most
:data:`FLAT_READS_PER_TOKEN` K/V positions per token (:func:`flattened_reads`); others
run piecewise as before.
A draft head's catch-up over such a step replays its catch-up graphs flattened by the
same rule (:mod:`lmkit.worker.draft_runner`). Bidirectional encoders never take it
(:func:`flat_step_tokens`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["FLAT_READS_PER_TOKEN", "fits_flat", "flat_step_tokens", "flattened_reads"]

#: the most K/V positions a flattened short step's attention may read per token
FLAT_READS_PER_TOKEN = 1024


def flattened_reads(num_scheduled: np.ndarray, num_computed: np.ndarray) -> int:
    """The K/V positions a flattened step's attention reads: the ``j``-th (from 1) of
    the ``s`` tokens of a request with ``c`` computed ones attends to ``c + j``."""
    s, c = num_scheduled.astype(np.int64), num_computed.astype(np.int64)
    return int((s * c + s * (s + 1) // 2).sum())


def fits_flat(flat_tokens: int, num_scheduled: np.ndarray, num_computed: np.ndarray) -> bool:
    """Whether a step of requests with ``num_scheduled`` tokens after ``num_computed``
    computed ones is a short step to flatten: at most ``flat_tokens`` tokens, the rows
    of its requests with several tokens reading at most :data:`FLAT_READS_PER_TOKEN`
    K/V positions per token (its decodes read their context in any decode step)."""
    n = int(num_scheduled.sum())
    several = num_scheduled > 1
    return 0 < n <= flat_tokens and flattened_reads(
        num_scheduled[several], num_computed[several]) <= (
        int(num_scheduled[several].sum()) * FLAT_READS_PER_TOKEN)


def flat_step_tokens(limit: int, model: Any, num_layers: int) -> int:
    """The short-step limit for ``model`` (``executor.flat_step_max_tokens`` is
    ``limit``): ``limit`` for a causal model, 0 when a KV cache group attends both ways
    (an encoder's prompt is no run of decode rows)."""
    groups = model.kv_cache_groups(num_layers)
    return limit if all(getattr(g.attn, "causal", True) for g in groups) else 0
