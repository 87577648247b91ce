"""Small-batch projections with their input transform folded into the weight stream:
``rms_norm(x + residual) @ W.T`` and ``(silu(gate) * up) @ W.T``, one kernel each.

At decode batch sizes the RMSNorm before the QKV and gate-up projections and the
SiLU-and-multiply before the down projection are separate kernels (a launch and a pass
over the activations each). Here the projection's weight-streaming kernel (the
structure of :mod:`lmkit_kernels.gemv`: each program owns ``BLOCK_N`` output columns
and streams their whole ``K`` extent, the at most 16 input rows padded to one 16-row
``tl.dot`` tile) computes the transform itself on every ``BLOCK_K`` slice of the input
it reads. The input rows are tiny next to the weight (8 KiB for a 4096-wide bf16 row)
and stay in L2, so every program recomputing them costs little.

The transform rounds exactly where the separate kernels round
(:mod:`lmkit_kernels.norm`, :mod:`lmkit_kernels.activation`), and the dot runs over
the same tiles as :func:`lmkit_kernels.gemv.small_m_linear` with the same ``BLOCK_K``,
so the result equals the two-kernel path up to the order of the float32 sum of squares
in the norm (the same in Triton's interpreter, where the outputs are bit-identical).

RMSNorm needs each row's ``1 / rms`` before its first product: every program computes
it in a prologue (one pass over the rows, in float32), whose latency another program
on the same SM hides where two fit in its shared memory (3 stages at one row on sm_90;
computing it inside the loop instead, behind the pipeline's first loads, made Triton
3.6 run the loop's transform on all 16 rows of the dot tile). The residual sum ``x +
residual``, the next layer's residual stream, is stored by program 0 alone.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.errors import OutOfResources

from lmkit_kernels.activation import silu_and_mul_ref
from lmkit_kernels.checks import (
    FLOAT_DTYPES,
    check_shape,
    check_tensor,
    dot_needs_f32,
    is_interpreting,
    next_power_of_2,
)
from lmkit_kernels.gemv import MAX_ROWS, glu_store, glu_tile_rows, glu_width, small_m_linear_ref
from lmkit_kernels.norm import rms_norm_ref
from lmkit_kernels.pdl import pdl_launch_args, pdl_wait, prefetch_args, prefetch_weight_rows

__all__ = ["SILU_TILE", "launch_config", "norm_small_m_linear", "norm_small_m_linear_ref",
           "silu_mul_small_m_linear", "silu_mul_small_m_linear_ref"]

_MAX_NORM_BLOCK = 8192  # the prologue reads rows in slices of at most this many elements
#: the most elements of a SiLU fold's transform tile (rows x K slice; see launch_config)
SILU_TILE = 2048
#: launch variant -> the stages that fit, learned when a launch ran out of shared memory
_STAGES_THAT_FIT: dict[tuple, int] = {}


@triton.jit
def _row_rstd(x_ptr, res_ptr, res_out_ptr, row, K, stride_xm, stride_rm, stride_hm,
              inv_k, eps, HAS_RESIDUAL: tl.constexpr, NORM_BLOCK: tl.constexpr):
    # 1 / rms of row ``row`` of x (+ residual), as lmkit_kernels.norm computes it; with a
    # residual, program 0 also stores the rounded sum
    cs = tl.arange(0, NORM_BLOCK)
    store_end = tl.where(tl.program_id(0) == 0, K, 0)  # (a mask bound: the interpreter
    # rejects a vector mask and-ed with a scalar one)
    ss = tl.zeros((1,), dtype=tl.float32)
    for k in range(0, K, NORM_BLOCK):
        ok = (k + cs) < K
        h = tl.load(x_ptr + row * stride_xm + k + cs, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_rm + k + cs, mask=ok, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_hm + k + cs, h, mask=(k + cs) < store_end)
        hf = h.to(tl.float32)
        ss += tl.sum(hf * hf, axis=0)
    return tl.rsqrt(ss * inv_k + eps)


@triton.jit
def _normed_tile(x_ptr, res_ptr, g_ptr, rows, cs, row_ok, k_ok, rstd, stride_xm, stride_rm,
                 HAS_RESIDUAL: tl.constexpr):
    # g * normalize(x + residual) over rows x cs, rounded as lmkit_kernels.norm rounds
    mask = row_ok[:, None] & k_ok[None, :]
    h = tl.load(x_ptr + rows[:, None] * stride_xm + cs[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_rm + cs[None, :], mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    normed = (h.to(tl.float32) * rstd[:, None]).to(x_ptr.dtype.element_ty)
    g = tl.load(g_ptr + cs, mask=k_ok, other=0.0)
    return (g.to(tl.float32)[None, :] * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)


@triton.jit
def _silu_mul_tile(x_ptr, rows, cs, row_ok, k_ok, stride_xm, K,
                   ACCURATE_EXP: tl.constexpr):
    # silu(gate) * up over rows x cs (gate: columns [0, K), up: [K, 2K)), rounded as
    # lmkit_kernels.activation rounds
    mask = row_ok[:, None] & k_ok[None, :]
    base = x_ptr + rows[:, None] * stride_xm + cs[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + K, mask=mask, other=0.0)
    if ACCURATE_EXP:  # libdevice expf, as torch's CUDA kernel (tl.exp is ex2.approx)
        e = libdevice.exp(-gate)
    else:  # the CPU interpreter: numpy's exp
        e = tl.exp(-gate)
    act = tl.math.div_rn(gate, 1.0 + e).to(x_ptr.dtype.element_ty)
    return (act.to(tl.float32) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)


@triton.jit
def _pad_rows(a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # [BLOCK_M, BLOCK_K] (2, 4 or 8 rows) -> [16, BLOCK_K], zeros below: each join
    # doubles the rows. (A broadcast, as for one row, lets Triton 3.6 move the transform
    # onto all 16 rows; through join and reshape it stays on BLOCK_M.)
    if BLOCK_M <= 8:
        a = tl.reshape(tl.permute(tl.join(a, tl.zeros_like(a)), (2, 0, 1)), (2 * BLOCK_M, BLOCK_K))
    if BLOCK_M <= 4:
        a = tl.reshape(tl.permute(tl.join(a, tl.zeros_like(a)), (2, 0, 1)), (4 * BLOCK_M, BLOCK_K))
    if BLOCK_M <= 2:
        a = tl.reshape(tl.permute(tl.join(a, tl.zeros_like(a)), (2, 0, 1)), (8 * BLOCK_M, BLOCK_K))
    return a


@triton.jit
def _fold_linear_kernel(
    x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, M, N, K,
    stride_xm, stride_rm, stride_hm, stride_wn, stride_om, inv_k, eps,
    SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr, DOT_F32: tl.constexpr, IEEE_DOT: tl.constexpr,
    ACCURATE_EXP: tl.constexpr, USE_PDL: tl.constexpr = False, PF_LINE: tl.constexpr = 1,
    PF_LINES: tl.constexpr = 0, GLU_OUT: tl.constexpr = False,
):
    # program n: out[:, n * BLOCK_N:(n + 1) * BLOCK_N] = transform(x) @ w[cols].T over
    # the whole K. The transform runs on BLOCK_M rows (M rounded up to a power of two):
    # no work on the padding rows of the 16-row dot tile, which hold zeros. GLU_OUT: the
    # tile of gemv.glu_tile_rows, stored as silu(gate) * up.
    pid = tl.program_id(0)
    rows = tl.arange(0, 16)
    arows = tl.arange(0, BLOCK_M)
    arow_ok = arows < M
    cols, col_ok = glu_tile_rows(pid, N, BLOCK_N, GLU_OUT)
    ks = tl.arange(0, BLOCK_K)
    prefetch_weight_rows(w_ptr, cols, N, K, stride_wn, PF_LINE, PF_LINES)
    pdl_wait(USE_PDL)  # x and the residual are earlier kernels' outputs
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if not SILU_MUL:
        for m in range(0, M):
            r = _row_rstd(x_ptr, res_ptr, res_out_ptr, m, K, stride_xm, stride_rm, stride_hm,
                          inv_k, eps, HAS_RESIDUAL, NORM_BLOCK)
            rstd = tl.where(arows == m, r, rstd)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    for k in range(0, K, BLOCK_K):
        k_ok = (k + ks) < K
        if SILU_MUL:
            a = _silu_mul_tile(x_ptr, arows, k + ks, arow_ok, k_ok, stride_xm, K, ACCURATE_EXP)
        else:
            a = _normed_tile(x_ptr, res_ptr, g_ptr, arows, k + ks, arow_ok, k_ok, rstd,
                             stride_xm, stride_rm, HAS_RESIDUAL)
        if BLOCK_M == 1:  # [1, BLOCK_K] -> the 16-row tile, zeros below
            a = tl.where(rows[:, None] == 0, a, tl.zeros((16, BLOCK_K), dtype=a.dtype))
        elif BLOCK_M < 16:
            a = _pad_rows(a, BLOCK_M, BLOCK_K)
        w = tl.load(w_base + (k + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)))
        elif IEEE_DOT:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GLU_OUT:
        glu_store(acc, out_ptr, rows, rows < M, pid, N, stride_om, BLOCK_N, ACCURATE_EXP)
    else:
        out = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_ok[None, :])


def launch_config(rows: int, silu_mul: bool, has_residual: bool, block_n: int, block_k: int,
                  num_stages: int, element_size: int, max_shared: int | None
                  ) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_K, num_stages)`` for a call over ``rows`` rows asked to run with
    ``block_k`` and ``num_stages``, on a device with ``max_shared`` bytes of shared memory
    per program (``None``: no limit, the interpreter).

    * ``BLOCK_M``: the rows the transform runs on, ``rows`` rounded up to a power of two
      (the dot still takes a 16-row tile, zero below).
    * The SiLU fold: a transform tile of at most :data:`SILU_TILE` elements (``K``
      slices of ``SILU_TILE / BLOCK_M`` for 8 and 16 rows), with as many more stages as
      keep the same weight bytes in flight (8 rows of SiLU over 512 columns, or 16 over
      256, spill registers on sm_90). On the GPU the dot accumulates in ``K`` order
      whatever the slice, so the result is unchanged; in the interpreter the slice sets
      the float32 sum order.
    * Stages: the input tiles (x and residual or gate and up, and the norm weight) are
      pipelined beside the weight's, ``num_stages - 1`` buffers of each, next to a
      scratch tile for the transformed input's move into the dot's layout; fewer stages
      where they would not fit (sm_90's 227 KiB hold 4 at ``block_n`` 32 and 16 rows).
    """
    block_m = next_power_of_2(rows)
    if silu_mul and block_m * block_k > SILU_TILE:
        narrow = max(16, SILU_TILE // block_m)
        num_stages = 1 + (num_stages - 1) * block_k // narrow
        block_k = narrow
    if max_shared is not None:
        tiles = (2 if silu_mul or has_residual else 1) * block_m + (0 if silu_mul else 1)
        stage_bytes = (block_n + tiles) * block_k * element_size
        room = max_shared - 16 * block_k * element_size
        num_stages = max(1, min(num_stages, 1 + room // stage_bytes))
    return block_m, block_k, num_stages


@functools.cache
def _max_shared_mem(device: torch.device) -> int | None:
    """Shared memory per program on ``device`` (Triton's driver), or ``None`` when this
    Triton does not say (then a launch that does not fit retries with fewer stages)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(index)
                   ["max_shared_mem"])
    except (AttributeError, KeyError, TypeError):
        return None


def _check_weight(x: torch.Tensor, k: int, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> int:
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device,
                 last_dim_contiguous=True)
    check_shape("weight", weight, (None, k))
    n = weight.shape[0]
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), device=x.device, contiguous=True)
        check_shape("bias", bias, (n,))
    return n


def _check_rows(name: str, x: torch.Tensor, what: str) -> None:
    check_tensor(name, x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{what} takes at most {MAX_ROWS} rows, got {x.shape[0]}; run the "
                         "separate kernels (or torch ops) for larger inputs")


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            k: int, *, residual: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, res_out: torch.Tensor | None = None,
            eps: float = 0.0, block_n: int, block_k: int, num_warps: int,
            num_stages: int, glu_out: bool = False) -> None:
    m, n = out.shape[0], weight.shape[0]
    if not m:
        return
    res = residual if residual is not None else x
    hsum = res_out if res_out is not None else x
    silu_mul = norm_weight is None
    block_m, block_k, stages = launch_config(
        m, silu_mul, residual is not None, block_n, block_k, num_stages, x.element_size(),
        None if is_interpreting() else _max_shared_mem(x.device))
    variant = (x.device, x.dtype, silu_mul, residual is not None, bias is not None, block_m,
               block_n, block_k, num_warps, glu_out)
    stages = min(stages, _STAGES_THAT_FIT.get(variant, stages))
    while True:
        try:
            # one program at least: program 0 stores the residual sum even when n == 0
            _fold_linear_kernel[(max(1, triton.cdiv(n, block_n)),)](
                x, res, norm_weight if norm_weight is not None else x, weight,
                bias if bias is not None else weight, out, hsum, m, n, k,
                x.stride(0), res.stride(0), hsum.stride(0), weight.stride(0), out.stride(0),
                1.0 / k if k else 0.0, float(eps),
                SILU_MUL=silu_mul, HAS_RESIDUAL=residual is not None,
                HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_K=block_k, NORM_BLOCK=min(max(16, next_power_of_2(k)), _MAX_NORM_BLOCK),
                DOT_F32=dot_needs_f32(x.dtype),
                IEEE_DOT=x.dtype == torch.float32 and not is_interpreting(),
                ACCURATE_EXP=not is_interpreting(), GLU_OUT=glu_out,
                num_warps=num_warps, num_stages=stages,
                enable_fp_fusion=False,  # round where the separate kernels round (no FMA)
                **prefetch_args(weight, block_k), **pdl_launch_args(x.device),
            )
            return
        except OutOfResources:
            # raised before anything is enqueued (safe inside a CUDA-graph capture)
            if stages <= 1:
                raise
            stages -= 1
            _STAGES_THAT_FIT[variant] = stages


def check_norm_inputs(x: torch.Tensor, residual: torch.Tensor | None,
                      norm_weight: torch.Tensor) -> torch.Tensor | None:
    """Check a folded norm's ``norm_weight`` (``[K]``, ``x``'s dtype) and ``residual``
    (``x``'s shape and dtype, unit last stride) against ``x: [M, K]``; return a new
    contiguous ``[M, K]`` tensor for the residual sum, or ``None`` without a residual.

    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    m, k = x.shape
    check_tensor("norm_weight", norm_weight, ndim=1, dtypes=(x.dtype,), device=x.device,
                 contiguous=True)
    check_shape("norm_weight", norm_weight, (k,))
    if residual is None:
        return None
    check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device,
                 last_dim_contiguous=True)
    check_shape("residual", residual, (m, k))
    return torch.empty((m, k), dtype=x.dtype, device=x.device)


def norm_small_m_linear(x: torch.Tensor, residual: torch.Tensor | None,
                        norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                        bias: torch.Tensor | None = None, *, block_n: int = 16,
                        block_k: int = 512, num_warps: int = 4, num_stages: int = 4,
                        glu_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h) @ weight.T (+ bias), h)`` with ``h = x + residual`` (``x`` when
    ``residual`` is None) for at most :data:`~lmkit_kernels.gemv.MAX_ROWS` rows: the
    same result as :func:`lmkit_kernels.norm.rms_norm` then
    :func:`lmkit_kernels.gemv.small_m_linear` with the same ``block_k``, in one kernel.
    With ``glu_out`` (``weight`` a ``[gate | up]`` projection) the first item is
    ``silu(gate) * up`` of that product, as ``small_m_linear(..., glu_out=True)``
    stores it.

    :param x: ``[M, K]``, float16, bfloat16 or float32, ``M <= 16``, unit last stride.
    :param residual: optional ``[M, K]`` in ``x``'s dtype, unit last stride.
    :param norm_weight: ``[K]`` in ``x``'s dtype, contiguous.
    :param eps: added to the mean square before the reciprocal square root.
    :param weight: ``[N, K]`` in ``x``'s dtype, unit last stride.
    :param bias: optional ``[N]``.
    :param block_n: output columns per program (a power of two >= 16).
    :param block_k: ``K`` slice per loop iteration (a power of two >= 16).
    :param glu_out: store ``silu(y[:, :N/2]) * y[:, N/2:]`` of the product ``y`` (``N``
        even).
    :return: a new ``[M, N]`` tensor (``[M, N / 2]`` with ``glu_out``) and the residual
        sum (a new ``[M, K]`` tensor, or ``x`` itself without ``residual``); inputs are
        not modified.
    :raises ValueError: on a shape, dtype, device or stride mismatch, ``M > 16``, or an
        odd ``N`` with ``glu_out``.
    """
    _check_rows("x", x, "norm_small_m_linear")
    m, k = x.shape
    res_out = check_norm_inputs(x, residual, norm_weight)
    n = _check_weight(x, k, weight, bias)
    out = torch.empty((m, glu_width(n, glu_out)), dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, k, residual=residual, norm_weight=norm_weight,
            res_out=res_out, eps=eps, block_n=block_n, block_k=block_k,
            num_warps=num_warps, num_stages=num_stages, glu_out=glu_out)
    return out, (res_out if res_out is not None else x)


def silu_mul_small_m_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, *, block_n: int = 16,
                            block_k: int = 512, num_warps: int = 4, num_stages: int = 4
                            ) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T (+ bias)`` for ``gate_up = [gate | up]`` of at most
    :data:`~lmkit_kernels.gemv.MAX_ROWS` rows: the same result as
    :func:`lmkit_kernels.activation.silu_and_mul` then
    :func:`lmkit_kernels.gemv.small_m_linear` with the same ``block_k``, in one kernel.

    :param gate_up: ``[M, 2 * I]``, float16, bfloat16 or float32, ``M <= 16``, unit
        last stride.
    :param weight: ``[N, I]`` in ``gate_up``'s dtype, unit last stride.
    :param bias: optional ``[N]``.
    :param block_k: ``K`` slice per loop iteration, at most :data:`SILU_TILE` divided by
        the rows rounded up to a power of two (:func:`launch_config`).
    :return: a new ``[M, N]`` tensor in ``gate_up``'s dtype.
    :raises ValueError: on a shape, dtype, device or stride mismatch, an odd width, or
        ``M > 16``.
    """
    _check_rows("gate_up", gate_up, "silu_mul_small_m_linear")
    m, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must have an even last dimension (gate, then up); got {width}")
    k = width // 2
    n = _check_weight(gate_up, k, weight, bias)
    out = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    _launch(gate_up, weight, bias, out, k, block_n=block_n, block_k=block_k,
            num_warps=num_warps, num_stages=num_stages)
    return out


def norm_small_m_linear_ref(x: torch.Tensor, residual: torch.Tensor | None,
                            norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                            bias: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`norm_small_m_linear`."""
    out = rms_norm_ref(x, norm_weight, eps, residual)
    normed, h = out if isinstance(out, tuple) else (out, x)
    return small_m_linear_ref(normed, weight, bias), h


def silu_mul_small_m_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of :func:`silu_mul_small_m_linear`."""
    return small_m_linear_ref(silu_and_mul_ref(gate_up), weight, bias)
