"""Paged attention with lmkit's own Triton kernels (:mod:`lmkit_kernels`).

Same cache layout as the torch reference, ``[2, num_blocks, block_size, num_kv_heads,
head_size]``, so the two are interchangeable on one cache. :meth:`TritonAttention.plan`
does O(batch) host work once per step: it counts the leading one-token (decode)
requests and picks the decode kernel's split count (the kernel merges its slices in the
same launch, counting them on counters this backend keeps zeroed; option
``decode_merge_in_kernel``). :meth:`TritonAttention.run` per
layer writes the new K/V through ``slot_mapping`` (unless the model already did, see
:meth:`TritonAttention.kv_write_slots`) and launches the split-K decode
kernel for the leading decodes and the causal prefill kernel for the rest (prefill,
cached prefix, chunked prefill, multi-token decode). It reads only device tensors and
host values fixed at plan time, so a pure-decode step can be captured in a CUDA graph:
the runner keeps the metadata tensors at fixed addresses and calls ``plan`` before
capture and before every replay. The decode split count depends on the batch shape
only (:func:`~lmkit_kernels.paged_attention.choose_decode_splits`), so a graph captured
with short contexts stays fast with long ones.

A draft-tree step (metadata ``tree_mask`` set; speculative decoding with a token tree)
runs every request through the prefill kernel with its tree variant, which reads each
request's region and each token's mask bits on the device: decodes included (the
decode kernel attends causally only), requests with region 0 causal as usual. Whether
a step has a tree is fixed by the metadata's structure, not by values, so a tree step's
plan stays valid when the values in its buffers change in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from lmkit.api import AttentionBackend, AttentionMetadata
from lmkit_kernels.cache_write import reshape_and_cache
from lmkit_kernels.paged_attention import (
    MAX_HEAD_SIZE,
    choose_decode_splits,
    paged_attention,
    split_counters,
)

from lmkit_plugins.attention import TritonAttentionOptions
from lmkit_plugins.attention.tree_mask import tree_regions

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _TritonPlan:
    num_reqs: int
    num_tokens: int
    num_decodes: int  # leading requests with one query token
    num_splits: int  # decode context slices
    max_prefill_query_len: int  # over the requests after the leading decodes
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    tree_region: torch.Tensor | None = None  # int32 [num_reqs]: a draft-tree step
    tree_mask: torch.Tensor | None = None  # int64 [num_tokens]


class TritonAttention(AttentionBackend):
    """Paged attention on CUDA with the Triton kernels of :mod:`lmkit_kernels`.

    Supports float32/float16/bfloat16, head sizes up to 256, GQA, mixed
    prefill/decode batches, cached prefixes and chunked prefill, an FP8 (e4m3) cache
    and draft trees. No sliding window.
    """

    supports_model_kv_write = True  # kv_write_slots(), run(..., kv_written=True)
    supports_fp8_kv_cache = True  # the cache write quantizes, the kernels widen and scale
    # decode kernels read seq_lens / slots / block tables on the device; the plan keeps
    # only counts and the split choice
    supports_in_place_decode_metadata = True
    supports_tree_mask = True  # tree steps: the prefill kernel's tree variant

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.sliding_window is not None:
            raise ValueError("the triton attention backend has no sliding-window support; "
                             "use --attention torch or --attention flashinfer for this model")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_size > MAX_HEAD_SIZE:
            raise ValueError(f"head_size {self.head_size} is above the triton backend's "
                             f"maximum {MAX_HEAD_SIZE}; use --attention torch")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype} is not supported by the triton backend "
                             "(float32, float16, bfloat16)")
        self.options = self.options or TritonAttentionOptions()
        self._plan: _TritonPlan | None = None
        # zeroed counters of the one-launch decode merge, grown in plan() (never during
        # CUDA-graph capture); outgrown buffers stay alive for graphs captured with them
        self._counters: torch.Tensor | None = None
        self._old_counters: list[torch.Tensor] = []

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``: keys, then values."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def plan(self, metadata: AttentionMetadata) -> None:
        """Count the leading decode requests and fix the decode split count (host only);
        a draft-tree step has no decodes (all its requests go to the prefill kernel)."""
        md = metadata
        num_reqs = md.num_reqs
        qsl = md.query_start_loc_cpu[: num_reqs + 1].numpy()
        query_lens = np.diff(qsl)
        not_decode = np.flatnonzero(query_lens != 1)
        num_decodes = int(not_decode[0]) if len(not_decode) else num_reqs
        tree_region, tree_mask = None, None
        if tree_regions(md) is not None:  # a draft-tree step (its host metadata checked)
            num_decodes = 0
            tree_region, tree_mask = md.tree_region, md.tree_mask
        max_prefill = int(query_lens[num_decodes:].max()) if num_decodes < num_reqs else 0
        splits = self.options.decode_num_splits or choose_decode_splits(
            max(num_decodes, 1), self.num_kv_heads, md.block_tables.device)
        if self.options.decode_merge_in_kernel and num_decodes:
            self._grow_counters(num_decodes, md.block_tables.device)
        self._plan = _TritonPlan(
            num_reqs=num_reqs, num_tokens=md.num_actual_tokens, num_decodes=num_decodes,
            num_splits=splits, max_prefill_query_len=max_prefill,
            query_start_loc=md.query_start_loc[: num_reqs + 1],
            seq_lens=md.seq_lens[:num_reqs], block_tables=md.block_tables[:num_reqs],
            slot_mapping=md.slot_mapping[: md.num_actual_tokens],
            tree_region=None if tree_region is None else tree_region[:num_reqs],
            tree_mask=None if tree_mask is None else tree_mask[: md.num_actual_tokens],
        )

    def _grow_counters(self, num_reqs: int, device: torch.device) -> None:
        """Make the split counters hold ``num_reqs`` requests (at least 64 at first)."""
        need = num_reqs * self.num_kv_heads
        if self._counters is None or self._counters.shape[0] < need:
            if self._counters is not None:
                self._old_counters.append(self._counters)
            self._counters = split_counters(max(num_reqs, 64), self.num_kv_heads, device)

    def kv_write_slots(self) -> torch.Tensor:
        """This step's ``slot_mapping``: models may write K/V themselves (fused with
        RoPE, :func:`lmkit_kernels.rotary.rotary_qk_`) and call ``run(...,
        kv_written=True)``; the cache layout is the one that function writes."""
        if self._plan is None:
            raise RuntimeError("TritonAttention.kv_write_slots() called before plan()")
        return self._plan.slot_mapping

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv_cache: torch.Tensor, *, kv_written: bool = False) -> torch.Tensor:
        """Write ``k``/``v`` at ``slot_mapping`` (unless ``kv_written``), then attend
        every request causally (a draft tree's requests as their mask bits say).

        :param q: ``[num_tokens, num_heads, head_size]`` (rows past the step's tokens,
            CUDA-graph padding, come back as zeros)
        :param k: ``[num_tokens, num_kv_heads, head_size]``
        :param v: ``[num_tokens, num_kv_heads, head_size]``
        :param kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``
        :param kv_written: the caller has already stored ``k``/``v`` at
            :meth:`kv_write_slots`.
        :return: ``[num_tokens, num_heads, head_size]`` in ``q``'s dtype
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("TritonAttention.run() called before plan() for this step")
        ks, vs = self.kv_scales(layer) if self.fp8_kv_cache else (1.0, 1.0)
        if not kv_written:
            reshape_and_cache(k, v, kv_cache, plan.slot_mapping, ks, vs)
        out = torch.empty_like(q)
        if q.shape[0] > plan.num_tokens:
            out[plan.num_tokens:].zero_()
        nd = plan.num_decodes
        if nd:
            paged_attention(q, kv_cache, plan.query_start_loc[: nd + 1], plan.seq_lens[:nd],
                            plan.block_tables[:nd], max_query_len=1, scale=self.scale,
                            out=out, num_splits=plan.num_splits,
                            split_counters=self._counters, decode_tiles=self.options.decode_tiles,
                            k_scale=ks, v_scale=vs)
        if nd < plan.num_reqs:
            paged_attention(q, kv_cache, plan.query_start_loc[nd:], plan.seq_lens[nd:],
                            plan.block_tables[nd:], max_query_len=plan.max_prefill_query_len,
                            scale=self.scale, out=out, k_scale=ks, v_scale=vs,
                            tree_region=plan.tree_region, tree_mask=plan.tree_mask)
        return out
