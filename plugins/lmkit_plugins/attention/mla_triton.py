"""MLA attention with lmkit's own Triton kernels (:mod:`lmkit_kernels.mla_attention`).

Cache layout per layer: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``
(``c_kv`` then ``k_pe``, the :class:`~lmkit.api.MLAAttentionBackend` contract).

:meth:`MLATritonAttention.plan` does O(batch) host work once per step: it splits the
step's requests into the leading short queries (decode and speculative verification,
at most ``absorbed_max_query_len`` tokens) and the rest (prefill, cached prefix,
chunked prefill), picks the decode split count, and for the rest builds the cache
slots of their contexts (``kv_slots``, gathered on the device from ``block_tables``, no
sync) and ``cu_seqlens_k``. :meth:`MLATritonAttention.run_mla` per layer:

1. writes the new ``[kv_c | k_pe]`` entries at ``slot_mapping``;
2. short queries, absorbed: ``q_lat = q_nope @ w_uk`` per head (a batched matmul),
   the split-K latent decode kernel (every latent tile read once for all heads), then
   ``out = out_lat @ w_uv^T`` per head;
3. the rest, decompressed: the contexts' latent entries times ``kv_b_proj`` give
   per-head ``k_nope`` and ``v``, and the causal varlen prefill kernel attends with
   ``[q_nope | q_pe] . [k_nope | k_pe]`` (192 wide in DeepSeek) and 128-wide values.
   The whole context is decompressed at once: memory ``num_keys * num_heads * (nope +
   v) * 2`` bytes per layer call (about 256 MiB for 32K keys at 16 heads).

A pure-decode step does no host work in ``run_mla`` (views of the metadata, a split
count fixed at plan time from the batch shape), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from lmkit.api import AttentionMetadata
from lmkit.api.mla_attention import MLAAttentionBackend
from lmkit_kernels.mla_attention import (
    absorb_query,
    apply_w_uv,
    decode_num_splits,
    decompress_latent,
    gather_latent,
    mla_decode,
    mla_prefill,
)
from lmkit_kernels.mla_cache_write import mla_cache_write
from lmkit_kernels.mla_ref import split_kv_b

from lmkit_plugins.attention.mla_options import MLAAttentionOptions, MLATritonAttentionOptions
from lmkit_plugins.attention.page_lists import context_slots, to_device

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _MLATritonPlan:
    num_reqs: int
    num_tokens: int
    num_decodes: int  # leading requests with short queries (absorbed path)
    num_decode_tokens: int
    max_decode_query_len: int
    num_splits: int
    max_prefill_query_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    kv_slots: torch.Tensor | None  # int64 [num_keys]: the prefill requests' contexts
    cu_seqlens_k: torch.Tensor | None  # int32 [num_prefills + 1]


class MLATritonAttention(MLAAttentionBackend):
    """Paged MLA on CUDA with lmkit's Triton kernels: absorbed split-K decode over the
    latent cache, decompressed causal prefill (float32, float16, bfloat16)."""

    options: MLAAttentionOptions  # set in __init__ (the subclass's options type may differ)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.sliding_window is not None:
            raise ValueError("the mla_triton attention backend has no sliding-window support "
                             f"(asked for a window of {self.sliding_window})")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype} is not supported by mla_triton (float32, "
                             "float16, bfloat16)")
        if not self.causal:
            raise ValueError("mla_triton attends causally only (MLA models are decoders)")
        self.options = self.options or MLATritonAttentionOptions()
        # a subclass (mla_flashinfer) brings its own options and its own decode kernel
        self._head_tile = (self.options.decode_head_tile  # None: by head count
                           if isinstance(self.options, MLATritonAttentionOptions) else None)
        self._plan: _MLATritonPlan | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        """Split the step into absorbed and decompressed requests; host work only, plus
        the device gather of the decompressed requests' context slots."""
        self.refuse_tree_metadata(metadata)
        md = metadata
        num_reqs = md.num_reqs
        qsl = md.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int64)
        query_lens = np.diff(qsl)
        long_query = np.flatnonzero((query_lens > self.options.absorbed_max_query_len)
                                    | (query_lens == 0))
        nd = int(long_query[0]) if len(long_query) else num_reqs
        if md.cuda_graph and nd != num_reqs:
            raise RuntimeError("mla_triton can capture only decode steps in a CUDA graph; "
                               f"this step has {num_reqs - nd} requests with longer queries. "
                               "Run such steps eagerly.")
        max_dec = int(query_lens[:nd].max()) if nd else 0
        device = md.block_tables.device
        splits = self._plan_absorbed(md, nd, max_dec)
        kv_slots = cu_k = None
        max_prefill = 0
        if nd < num_reqs:
            seq_lens = md.seq_lens_cpu[nd:num_reqs].numpy()
            kv_slots = context_slots(md.block_tables[nd:num_reqs], seq_lens, self.block_size)
            cu = np.zeros(num_reqs - nd + 1, dtype=np.int32)
            cu[1:] = np.cumsum(seq_lens)
            cu_k = to_device(torch.from_numpy(cu), device)
            max_prefill = int(query_lens[nd:].max())
        self._plan = _MLATritonPlan(
            num_reqs=num_reqs, num_tokens=md.num_actual_tokens, num_decodes=nd,
            num_decode_tokens=int(qsl[nd]), max_decode_query_len=max_dec, num_splits=splits,
            max_prefill_query_len=max_prefill,
            query_start_loc=md.query_start_loc[: num_reqs + 1],
            seq_lens=md.seq_lens[:num_reqs], block_tables=md.block_tables[:num_reqs],
            slot_mapping=md.slot_mapping[: md.num_actual_tokens], kv_slots=kv_slots,
            cu_seqlens_k=cu_k)

    def _plan_absorbed(self, md: AttentionMetadata, num_decodes: int,
                       max_query_len: int) -> int:
        """Plan the absorbed part (the leading ``num_decodes`` requests); returns the
        decode kernel's split count, fixed by the batch shape."""
        assert isinstance(self.options, MLATritonAttentionOptions)
        return self.options.decode_num_splits or decode_num_splits(
            max(num_decodes, 1), self.num_heads, max_query_len, md.block_tables.device,
            self.dtype, head_tile=self._head_tile)

    def attend_latent(self, plan: _MLATritonPlan, q_lat: torch.Tensor, q_pe: torch.Tensor,
                         kv_cache: torch.Tensor) -> torch.Tensor:
        """The latent output ``[num_decode_tokens, num_heads, kv_lora_rank]`` of the
        leading short queries (``q_lat``: ``[num_decode_tokens, num_heads, rank]``)."""
        nd = plan.num_decodes
        return mla_decode(q_lat, q_pe, kv_cache, plan.query_start_loc[: nd + 1],
                          plan.seq_lens[:nd], plan.block_tables[:nd],
                          max_query_len=plan.max_decode_query_len, scale=self.scale,
                          num_splits=plan.num_splits, head_tile=self._head_tile)

    def run_mla(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                w_kv_b: torch.Tensor) -> torch.Tensor:
        """Write the step's latent entries, then attend (see the module docstring).

        Rows past the step's tokens (CUDA-graph padding) come back as zeros.
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("MLATritonAttention.run_mla() called before plan() for this step")
        mla_cache_write(kv_c, k_pe, kv_cache, plan.slot_mapping)
        num_rows, num_heads = q_nope.shape[0], self.num_heads
        out = torch.empty((num_rows, num_heads, self.v_head_dim), dtype=q_nope.dtype,
                          device=q_nope.device)
        if num_rows > plan.num_tokens:
            out[plan.num_tokens:].zero_()
        nd, td = plan.num_decodes, plan.num_decode_tokens
        if nd:
            w_uk, w_uv = split_kv_b(w_kv_b, num_heads, self.qk_nope_head_dim)
            q_lat = absorb_query(q_nope[:td], w_uk).transpose(0, 1)  # [td, heads, rank]
            out[:td] = apply_w_uv(self.attend_latent(plan, q_lat, q_pe[:td], kv_cache), w_uv)
        if nd < plan.num_reqs:
            assert plan.kv_slots is not None and plan.cu_seqlens_k is not None
            latent = gather_latent(kv_cache, plan.kv_slots)
            k_nope, k_pe_ctx, v = decompress_latent(latent, w_kv_b, num_heads,
                                                    self.qk_nope_head_dim)
            mla_prefill(q_nope, q_pe, k_nope, k_pe_ctx, v, plan.query_start_loc[nd:],
                        plan.cu_seqlens_k, max_query_len=plan.max_prefill_query_len,
                        scale=self.scale, out=out)
        return out
