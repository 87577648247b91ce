"""Float32 decode attention over the paged KV cache on the CPU (C kernel).

For a step in which every request decodes one token, :func:`paged_decode_attention`
stores the step's keys and values at their slots and attends each request's query
straight from its cache blocks (``paged_decode.c``). torch's path gathers every
request's blocks into a contiguous copy and runs ``scaled_dot_product_attention``,
about 70 us per layer for a single SmolLM2 stream (2-core AMD EPYC, ~80 tokens of
context); the kernel takes about 21 us there, 12 us of it computing. On AVX-512 CPUs a
KV head's query group shares each pass over its keys (``attend_grouped``): 47.1 -> 18.1
us per layer at 250 tokens of context, 195 -> 68 at 1,000, on a 2-core Xeon
(bench/cpu_paged_decode.py's setting: 30 layers' caches, one thread, paired rounds).

The cache layout is the one every lmkit backend shares,
``[2, num_blocks, block_size, num_kv_heads, head_size]``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from lmkit_kernels.cpu.build import bind_kernel_library
from lmkit_kernels.cpu.checks import require_float32_cpu, require_kernel

__all__ = ["decode_attention_kernel", "paged_decode_attention",
           "paged_decode_unavailable_reason"]

SOURCE = Path(__file__).with_name("paged_decode.c")
ABI = 1
_P, _L = ctypes.c_void_p, ctypes.c_long

DecodeFn = Callable[..., torch.Tensor]


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    return bind_kernel_library(
        SOURCE, "lmkit_paged_decode_abi", ABI, what="CPU paged decode kernel",
        fallback="torch attention", functions={
            "lmkit_store_kv": ([_P, _L, _P, _L, _P, _L, _P, _L, _L], None),
            "lmkit_paged_decode": ([_P, _L, _P, _L, _P, _L, _P, _P, _L, _L, _L, _L, _L,
                                    ctypes.c_float, _L, ctypes.c_int], ctypes.c_int)})


def paged_decode_unavailable_reason() -> str:
    """Why the kernel is not available (empty when it is)."""
    return _library()[1]


def decode_attention_kernel() -> DecodeFn | None:
    """The kernel without per-call checks (for a backend's ``run``), or ``None``.

    ``fn(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, scale, window) ->
    out``: the caller guarantees what :func:`paged_decode_attention` checks.
    """
    lib = _library()[0]
    if lib is None:
        return None
    store, decode = lib.lmkit_store_kv, lib.lmkit_paged_decode

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
            slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            scale: float, window: int) -> torch.Tensor:
        n, num_heads, head_size = q.shape
        num_kv_heads = k.shape[1]
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        store(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(),
              n, kv_cache.data_ptr(), num_slots, num_kv_heads * head_size)
        out = torch.empty(n, num_heads, head_size, dtype=torch.float32)
        if decode(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), num_slots,
                  block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
                  out.data_ptr(), n, num_heads, num_kv_heads, head_size, kv_cache.shape[2],
                  scale, window, torch.get_num_threads()) != 0:
            raise MemoryError("paged decode attention: cannot allocate its score buffer")
        return out

    return run


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *,
                           scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Store ``k``/``v`` at ``slot_mapping``, then attend one query token per request.

    :param q: float32 ``[num_reqs, num_heads, head_size]`` (rows may be strided, heads
        and head dims contiguous), request ``r``'s new token
    :param k: float32 ``[num_reqs, num_kv_heads, head_size]``, likewise ``v``
    :param kv_cache: float32 contiguous ``[2, num_blocks, block_size, num_kv_heads,
        head_size]``
    :param slot_mapping: int64 ``[num_reqs]``, the new token's cache slot (-1: none)
    :param block_tables: int32 ``[num_reqs, max_blocks]`` (unit stride along blocks)
    :param seq_lens: int32 ``[num_reqs]``, context length including the new token
    :return: float32 ``[num_reqs, num_heads, head_size]``

    Raises ``RuntimeError`` when the kernel is not available and ``ValueError`` for
    inputs it does not take.
    """
    fn = require_kernel(decode_attention_kernel(), "CPU paged decode kernel",
                        paged_decode_unavailable_reason())
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or kv_cache.dim() != 5:
        raise ValueError("paged_decode_attention: expected q/k/v [n, heads, head_size] and "
                         "a [2, num_blocks, block_size, num_kv_heads, head_size] cache")
    n, num_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    if (k.shape[0] != n or k.shape[2] != head_size or kv_cache.shape[0] != 2
            or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_size)):
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)} "
                         f"and cache {tuple(kv_cache.shape)} do not fit together")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    require_float32_cpu("paged_decode_attention", q=q, k=k, v=v, kv_cache=kv_cache)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != head_size:
            raise ValueError(f"paged_decode_attention: {name}'s heads must be contiguous")
    if not kv_cache.is_contiguous():
        raise ValueError("paged_decode_attention: kv_cache must be contiguous")
    if (slot_mapping.dtype != torch.int64 or block_tables.dtype != torch.int32
            or seq_lens.dtype != torch.int32):
        raise ValueError("paged_decode_attention: slot_mapping must be int64, block_tables "
                         "and seq_lens int32")
    if slot_mapping.shape[0] < n or seq_lens.shape[0] < n or block_tables.shape[0] < n:
        raise ValueError(f"paged_decode_attention: metadata for fewer than {n} requests")
    slot_mapping, seq_lens = slot_mapping.contiguous(), seq_lens.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    lens = seq_lens[:n]
    if n and int(lens.min()) < 1:
        raise ValueError("paged_decode_attention: every request needs seq_len >= 1")
    if n and int(lens.max()) > block_tables.shape[1] * kv_cache.shape[2]:
        raise ValueError("paged_decode_attention: a seq_len exceeds its block table")
    return fn(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, scale,
              sliding_window or 0)
