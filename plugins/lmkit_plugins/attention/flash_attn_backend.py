"""Paged attention with FlashAttention (FA4, FA3 or FA2, see :mod:`.flash_attn_generations`).

Cache layout: lmkit's ``[2, num_blocks, block_size, num_kv_heads, head_size]``. Its two
halves ``kv_cache[0]`` and ``kv_cache[1]`` are each a contiguous ``[num_pages,
page_size, num_kv_heads, head_dim]`` paged cache, the layout all three generations
take with a page table, so this backend shares caches with the other backends. New K/V
are written by lmkit's Triton ``reshape_and_cache`` (through ``slot_mapping``), or by
the model (``kv_write_slots``).

FlashAttention's varlen kernels take a mixed batch in one call: ``cu_seqlens_q`` packs
the queries, ``seqused_k`` (FA2: ``cu_seqlens_k``) gives each request's context after
this step, and the causal mask is aligned to the end of the keys, so query ``i`` of a
request with context ``c`` before the step sees keys ``<= c + i``: decode, prefill,
prefill over a cached prefix, chunked prefill and multi-token queries alike.
:meth:`FlashAttnAttention.plan` builds those arguments once per step from views of the
metadata tensors (no copies, no sync); :meth:`run` makes one library call per layer.
That call does the library's own host work (FA4's Python interface checks its arguments
and looks up the compiled kernel on every call), which CUDA graphs hide for decode steps.
Logit soft-capping (the libraries' ``softcap``) is not passed: lmkit's models ask none.

CUDA graphs: a decode step planned with ``metadata.cuda_graph = True`` uses the runner's
fixed metadata buffers as they are; FA2's ``cu_seqlens_k`` is written in place into a
buffer this backend keeps. Padding requests (context 0) come back as zeros. Host-side
bounds are fixed per graph: ``max_seqlen_k`` is the block table's width in tokens.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lmkit.api import AttentionBackend, AttentionMetadata
from lmkit_kernels.cache_write import reshape_and_cache

from lmkit_plugins.attention import FlashAttnAttentionOptions
from lmkit_plugins.attention.flash_attn_generations import choose_generation


@dataclass
class FlashAttnPlan:
    """One step's FlashAttention arguments (views of the metadata tensors)."""

    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seqlen_k: int  # bound: the block table's width in tokens
    cu_seqlens_q: torch.Tensor  # int32 [num_reqs + 1]
    seqused_k: torch.Tensor  # int32 [num_reqs]
    page_table: torch.Tensor  # int32 [num_reqs, max_num_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    cu_seqlens_k: torch.Tensor | None = None  # int32 [num_reqs + 1] (FA2 only)


def build_plan(md: AttentionMetadata, block_size: int,
               cu_seqlens_k: torch.Tensor | None = None) -> FlashAttnPlan:
    """FlashAttention's view of one step (host work O(num_reqs), no device sync).

    :param cu_seqlens_k: when given (FA2), an int32 buffer of at least ``num_reqs + 1``
        elements on the metadata's device; the cumulative contexts are written into its
        first ``num_reqs + 1`` in place (a fixed address, for CUDA graphs).
    """
    num_reqs = md.num_reqs
    qsl = md.query_start_loc_cpu[: num_reqs + 1].numpy()
    max_query_len = int(np.diff(qsl).max()) if num_reqs else 0
    seqused_k = md.seq_lens[:num_reqs]
    cu_k = None
    if cu_seqlens_k is not None:
        cu_k = cu_seqlens_k[: num_reqs + 1]
        cu_k[:1].zero_()
        torch.cumsum(seqused_k, 0, dtype=torch.int32, out=cu_k[1:])
    return FlashAttnPlan(
        num_reqs=num_reqs, num_tokens=md.num_actual_tokens, max_query_len=max_query_len,
        max_seqlen_k=md.block_tables.shape[1] * block_size,
        cu_seqlens_q=md.query_start_loc[: num_reqs + 1], seqused_k=seqused_k,
        page_table=md.block_tables[:num_reqs], slot_mapping=md.slot_mapping[: md.num_actual_tokens],
        cu_seqlens_k=cu_k)


def window_size(sliding_window: int | None, generation: str) -> tuple[Any, Any]:
    """FlashAttention's ``window_size`` for lmkit's ``sliding_window`` (a query at
    position ``p`` sees keys ``> p - sliding_window``, i.e. ``sliding_window - 1`` to
    its left). FA4 spells "no window" ``None``, FA3 and FA2 ``-1``."""
    if sliding_window is None:
        return (None, None) if generation == "fa4" else (-1, -1)
    return (sliding_window - 1, 0)


class FlashAttnAttention(AttentionBackend):
    """FlashAttention paged attention (float16/bfloat16, GQA, sliding window, mixed
    prefill/decode, cached prefixes, chunked prefill, multi-token queries, CUDA graphs).
    """

    supports_model_kv_write = True  # kv_write_slots(), run(..., kv_written=True)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        self.options = self.options or FlashAttnAttentionOptions()
        self.generation = choose_generation(
            self.options.generation, head_size=self.head_size, block_size=self.block_size,
            dtype=str(self.dtype).removeprefix("torch."), capability=self.device_capability())
        self._attend = _KERNELS[self.generation]()
        self._window = window_size(self.sliding_window, self.generation)
        self._plan: FlashAttnPlan | None = None
        # FA2's cu_seqlens_k, grown in plan() (never during capture); outgrown buffers
        # stay alive for the graphs captured with them
        self._cu_seqlens_k: torch.Tensor | None = None
        self._old_buffers: list[torch.Tensor] = []

    def device_capability(self) -> tuple[int, int]:
        """The compute capability of this backend's CUDA device.

        :raises ValueError: for a device that is not CUDA
        """
        device = torch.device(self.device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"flash_attn attention runs on CUDA devices, not {device}; "
                             "use --attn torch or --attn cpu")
        return torch.cuda.get_device_capability(device)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``: keys, then values."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def plan(self, metadata: AttentionMetadata) -> None:
        """Build this step's FlashAttention arguments (see :func:`build_plan`)."""
        self.refuse_tree_metadata(metadata)
        buffer = None
        if self.generation == "fa2":
            need = metadata.num_reqs + 1
            if self._cu_seqlens_k is None or self._cu_seqlens_k.shape[0] < need:
                if self._cu_seqlens_k is not None:
                    self._old_buffers.append(self._cu_seqlens_k)
                self._cu_seqlens_k = torch.zeros(max(need, 257), dtype=torch.int32,
                                                 device=metadata.seq_lens.device)
            buffer = self._cu_seqlens_k
        self._plan = build_plan(metadata, self.block_size, buffer)

    def kv_write_slots(self) -> torch.Tensor:
        """This step's ``slot_mapping``: models may write K/V themselves (the cache is
        lmkit's layout) and call ``run(..., kv_written=True)``."""
        if self._plan is None:
            raise RuntimeError("FlashAttnAttention.kv_write_slots() called before plan()")
        return self._plan.slot_mapping

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv_cache: torch.Tensor, *, kv_written: bool = False) -> torch.Tensor:
        """Write ``k``/``v`` at ``slot_mapping`` (unless ``kv_written``), then attend
        every request causally with one FlashAttention call.

        :param q: ``[num_tokens, num_heads, head_size]`` (rows past the step's tokens
            come back as zeros)
        :param k: ``[num_tokens, num_kv_heads, head_size]``
        :param v: ``[num_tokens, num_kv_heads, head_size]``
        :param kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``
        :return: ``[num_tokens, num_heads, head_size]`` in ``q``'s dtype
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("FlashAttnAttention.run() called before plan() for this step")
        if not kv_written:
            reshape_and_cache(k, v, kv_cache, plan.slot_mapping)
        n = plan.num_tokens
        out = torch.empty_like(q)
        if q.shape[0] > n:
            out[n:].zero_()
        if n:
            # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_size] each
            out[:n] = self._attend(q[:n], kv_cache[0], kv_cache[1], plan, self.scale,
                                   self._window)
        return out


# ---------------------------------------------------------------- one call per generation
# Each factory imports its library (the heavy import happens when the backend is built)
# and returns attend(q, k_cache, v_cache, plan, scale, window) -> [n, heads, head_size].

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, FlashAttnPlan, float, Any],
                  torch.Tensor]


def _fa4() -> Attend:
    fa4 = importlib.import_module("flash_attn.cute")

    def attend(q, k_cache, v_cache, plan, scale, window):
        result = fa4.flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=plan.cu_seqlens_q, seqused_k=plan.seqused_k,
            max_seqlen_q=plan.max_query_len, max_seqlen_k=plan.max_seqlen_k,
            page_table=plan.page_table, softmax_scale=scale, causal=True,
            window_size=window)
        return result[0] if isinstance(result, tuple) else result  # (out, lse) or out
    return attend


def _fa3() -> Attend:
    fa3 = importlib.import_module("flash_attn_interface")

    def attend(q, k_cache, v_cache, plan, scale, window):
        result = fa3.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=plan.seqused_k, page_table=plan.page_table,
            cu_seqlens_q=plan.cu_seqlens_q, max_seqlen_q=plan.max_query_len,
            softmax_scale=scale, causal=True, window_size=window)
        return result[0] if isinstance(result, tuple) else result
    return attend


def _fa2() -> Attend:
    fa2 = importlib.import_module("flash_attn")

    def attend(q, k_cache, v_cache, plan, scale, window):
        return fa2.flash_attn_varlen_func(
            q, k_cache, v_cache, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_query_len,
            plan.max_seqlen_k, softmax_scale=scale, causal=True, window_size=window,
            block_table=plan.page_table)
    return attend


_KERNELS: dict[str, Callable[[], Attend]] = {"fa4": _fa4, "fa3": _fa3, "fa2": _fa2}
