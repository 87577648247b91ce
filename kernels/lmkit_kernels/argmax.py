"""``torch.argmax(x, dim=-1)`` of a few long rows (a decode step's logits) in two short
kernels.

Greedy decoding takes the argmax of each row of logits: at batch 1 over Llama-3's
128,256-entry vocabulary torch's reduction took 28 us per step on an H100 (W2's
profile, session 12), about four decode layers' attention. Here each row is cut into
``BLOCK``-wide chunks, one program per (row, chunk) finds its chunk's largest value and
the first index holding it, and a second kernel picks, per row, the first chunk holding
the row's largest value. Both launch with programmatic dependent launch.

The result is exactly ``torch.argmax``'s: the first index of the maximum; a NaN counts
as larger than everything (the first NaN's index wins); a row of ``-inf`` gives 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import FLOAT_DTYPES, check_tensor, next_power_of_2
from lmkit_kernels.pdl import pdl_launch_args, pdl_wait

__all__ = ["BLOCK", "argmax_rows"]

#: elements of a row per program of the first kernel
BLOCK = 4096


@triton.jit
def _chunk_argmax_kernel(x_ptr, val_ptr, idx_ptr, V, stride_row, CHUNKS: tl.constexpr,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    # program (row, chunk): the chunk's largest value (NaN if it holds one) and the first
    # index holding it (the first NaN's)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    pdl_wait(USE_PDL)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(x_ptr + row * stride_row + offs, mask=ok, other=float("-inf")).to(tl.float32)
    is_nan = (x != x) & ok
    first_nan = tl.min(tl.where(is_nan, offs, V), axis=0)
    top = tl.max(tl.where(is_nan, float("-inf"), x), axis=0)
    first_top = tl.min(tl.where((x == top) & ok, offs, V), axis=0)
    has_nan = first_nan < V
    out = row * CHUNKS + chunk
    tl.store(val_ptr + out, tl.where(has_nan, float("nan"), top))
    tl.store(idx_ptr + out, tl.where(has_nan, first_nan, first_top))


@triton.jit
def _rows_argmax_kernel(val_ptr, idx_ptr, out_ptr, CHUNKS: tl.constexpr,
                        CHUNKS_PAD: tl.constexpr, USE_PDL: tl.constexpr = False):
    # program row: the first chunk holding a NaN, else the first holding the row's top
    row = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    c = tl.arange(0, CHUNKS_PAD)
    ok = c < CHUNKS
    val = tl.load(val_ptr + row * CHUNKS + c, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * CHUNKS + c, mask=ok, other=0)
    is_nan = (val != val) & ok
    first_nan = tl.min(tl.where(is_nan, c, CHUNKS), axis=0)
    top = tl.max(tl.where(is_nan, float("-inf"), val), axis=0)
    first_top = tl.min(tl.where((val == top) & ok, c, CHUNKS), axis=0)
    pick = tl.where(first_nan < CHUNKS, first_nan, first_top)
    best = tl.sum(tl.where(c == pick, idx, 0), axis=0)
    tl.store(out_ptr + row, best.to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` for a 2-D ``x`` (see the module docstring).

    :param x: ``[rows, V]``, float32, float16 or bfloat16, unit last stride, ``V < 2**31``.
    :return: int64 ``[rows]`` on ``x``'s device.
    :raises ValueError: on a shape, dtype or stride mismatch, or empty rows.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    rows, vocab = x.shape
    if vocab == 0:
        raise ValueError("argmax_rows needs rows of at least one element, got 0")
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, BLOCK)
    val = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    pdl = pdl_launch_args(x.device)
    _chunk_argmax_kernel[(rows, chunks)](x, val, idx, vocab, x.stride(0), CHUNKS=chunks,
                                         BLOCK=BLOCK, num_warps=8, **pdl)
    _rows_argmax_kernel[(rows,)](val, idx, out, CHUNKS=chunks,
                                 CHUNKS_PAD=max(2, next_power_of_2(chunks)), num_warps=1, **pdl)
    return out
