"""A speculative device step's bookkeeping in two kernels instead of some thirty.

A device step (``lmkit.worker.spec_device_step``) decides on the GPU, behind a
verification, what the host used to: how many drafts each request keeps, where the
head's chained draft passes write, and the next verification's inputs, positions and
cache slots. In torch ops that is a comparison, a cumulative product and a sum, a dozen
additions, two slot lookups of six kernels each, stacks, concatenations and copies:
about thirty launches of a few hundred integers each, a fifth of a batch-1 step's
kernels on SmolLM2-135M. Here one program per request does each half:

* :func:`plan_step` (after the verification): the accepted count ``a`` (drafts equal to
  the target's argmax before the first that is not), the last kept position ``last =
  start + a`` and row ``r (1 + k) + a``, and the chained passes' positions ``last + j``,
  cache slots and sequence lengths (``j = 1 .. k - 1``);
* :func:`finish_step` (after the drafts): the step's decisions ``[argmax row, a,
  drafts]``, and the next verification's inputs ``[argmax[a], drafts]``, positions
  ``last + 1 ..`` and slots, into the caller's buffers.

Both are exact integer arithmetic, the same values as the torch ops they replace
(``lmkit.api.SamplingKernels``' default ``plan_device_step`` and ``finish_device_step``,
against which the tests check them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import next_power_of_2

__all__ = ["finish_step", "plan_step"]


@triton.jit
def _slot(tables_ptr, row, stride_tab, p, bs, mask):
    # the cache slot of position p through request row's block table
    block = tl.load(tables_ptr + row * stride_tab + p // bs, mask=mask, other=0).to(tl.int64)
    return block * bs + p % bs


@triton.jit
def _plan_kernel(targets_ptr, inputs_ptr, start_ptr, tables_ptr, acc_ptr, last_ptr, rows_ptr,
                 chain_ptr, n, stride_t, stride_i, stride_s, stride_tab, bs,
                 K: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    ok = j < K
    t = tl.load(targets_ptr + r * stride_t + j, mask=ok, other=0)
    d = tl.load(inputs_ptr + r * stride_i + 1 + j, mask=ok, other=0)
    a = tl.min(tl.where(ok & (t != d), j, K), axis=0).to(tl.int64)
    last = tl.load(start_ptr + r * stride_s) + a
    tl.store(acc_ptr + r, a)
    tl.store(last_ptr + r, last)
    tl.store(rows_ptr + r, r * (K + 1) + a)
    if K > 1:  # chained pass j (1 .. K - 1) writes position last + j: row j - 1 of chain
        on = (j >= 1) & ok
        p = last + j
        base = chain_ptr + (j - 1) * 3 * n + r
        tl.store(base, p, mask=on)
        tl.store(base + n, _slot(tables_ptr, r, stride_tab, p, bs, on), mask=on)
        tl.store(base + 2 * n, p + 1, mask=on)


@triton.jit
def _finish_kernel(targets_ptr, acc_ptr, last_ptr, first_ptr, rest_ptr, tables_ptr,
                   decided_ptr, inputs_ptr, pos_ptr, slots_ptr,
                   stride_t, stride_rest, stride_tab, stride_d, stride_in, stride_pos,
                   stride_sl, bs, K: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    w = tl.arange(0, BLOCK)
    wide = w < K + 1  # a verification row: the last token and K drafts
    t = tl.load(targets_ptr + r * stride_t + w, mask=wide, other=0)
    a = tl.load(acc_ptr + r)
    # draft j: the catch-up's (first) for j = 0, then row j - 1 of rest
    is_draft = w < K
    later = (w >= 1) & is_draft
    rest = tl.load(rest_ptr + (w - 1) * stride_rest + r, mask=later, other=0)
    drafts = tl.where(w == 0, tl.load(first_ptr + r), rest)
    tl.store(decided_ptr + r * stride_d + w, t, mask=wide)
    tl.store(decided_ptr + r * stride_d + K + 1, a)
    tl.store(decided_ptr + r * stride_d + K + 2 + w, drafts, mask=is_draft)
    bonus = tl.sum(tl.where(w == a, t, 0), axis=0)
    tl.store(inputs_ptr + r * stride_in, bonus)
    tl.store(inputs_ptr + r * stride_in + 1 + w, drafts, mask=is_draft)
    p = tl.load(last_ptr + r) + 1 + w
    tl.store(pos_ptr + r * stride_pos + w, p, mask=wide)
    tl.store(slots_ptr + r * stride_sl + w, _slot(tables_ptr, r, stride_tab, p, bs, wide),
             mask=wide)


def _check_ids(name: str, t: torch.Tensor, shape: tuple[int, ...], unit_last: bool = True
               ) -> None:
    if t.dtype != torch.int64 or tuple(t.shape) != shape or (unit_last and t.stride(-1) != 1):
        raise ValueError(f"{name}: expected int64 {list(shape)} with unit last stride, got "
                         f"{t.dtype} {list(t.shape)} strides {list(t.stride())}")


def plan_step(targets: torch.Tensor, inputs: torch.Tensor, start: torch.Tensor,
              tables: torch.Tensor, block_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(accepted, last, last_rows, chain)`` of a verification of ``n`` requests with
    ``k`` drafts each (module docstring).

    :param targets: int64 ``[n, 1 + k]``, the verification's argmax per row.
    :param inputs: int64 ``[n, 1 + k]``, each request's last token, then its drafts.
    :param start: int64 ``[n]`` (any stride), each request's first verified position.
    :param tables: int32 ``[n, blocks]``, unit last stride, covering ``start + 2k + 1``.
    :param block_size: tokens per cache block.
    :return: int64 ``accepted [n]``, ``last [n]`` (``start + accepted``), ``last_rows
        [n]`` (``i (1 + k) + accepted``) and ``chain [k - 1, 3, n]`` (positions, slots,
        sequence lengths of the chained passes ``j = 1 .. k - 1``).
    :raises ValueError: on a shape, dtype or stride mismatch.
    """
    n, width = targets.shape
    k = width - 1
    _check_ids("targets", targets, (n, width))
    _check_ids("inputs", inputs, (n, width))
    _check_ids("start", start, (n,), unit_last=False)
    if tables.dtype != torch.int32 or tables.dim() != 2 or tables.shape[0] != n:
        raise ValueError(f"tables: expected int32 [{n}, blocks], got {tables.dtype} "
                         f"{list(tables.shape)}")
    kw = {"dtype": torch.int64, "device": targets.device}
    accepted, last, rows = (torch.empty(n, **kw) for _ in range(3))
    chain = torch.empty(max(k - 1, 0), 3, n, **kw)
    if n:
        _plan_kernel[(n,)](targets, inputs, start, tables, accepted, last, rows, chain, n,
                           targets.stride(0), inputs.stride(0), start.stride(0),
                           tables.stride(0), block_size, K=k, BLOCK=next_power_of_2(max(k, 1)))
    return accepted, last, rows, chain


def finish_step(targets: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor,
                first: torch.Tensor, rest: torch.Tensor | None, tables: torch.Tensor,
                block_size: int, decided: torch.Tensor, inputs: torch.Tensor,
                positions: torch.Tensor, slots: torch.Tensor) -> None:
    """Write a device step's decisions and its next verification (module docstring).

    :param targets: int64 ``[n, 1 + k]``; ``accepted``, ``last``: :func:`plan_step`'s.
    :param first: int64 ``[n]``, each request's first new draft.
    :param rest: int64 ``[k - 1, n]`` (unit last stride), the others (``None`` for k=1).
    :param tables: int32 ``[n, blocks]``, covering ``last + k + 1``.
    :param decided: int64 ``[n, 2 (1 + k)]`` out: the argmax row, ``accepted``, the drafts.
    :param inputs: int64 ``[n, 1 + k]`` out: ``targets[i, accepted[i]]``, then the drafts.
    :param positions: int64 ``[n, 1 + k]`` out: ``last + 1 ..``; ``slots`` alike, their
        cache slots.
    :raises ValueError: on a shape, dtype or stride mismatch.
    """
    n, width = targets.shape
    k = width - 1
    _check_ids("targets", targets, (n, width))
    for name, t in (("accepted", accepted), ("last", last), ("first", first)):
        _check_ids(name, t, (n,))
    if k > 1:
        if rest is None:
            raise ValueError(f"rest: the other {k - 1} drafts are needed for k={k}")
        _check_ids("rest", rest, (k - 1, n))
    _check_ids("decided", decided, (n, 2 * width))
    for name, t in (("inputs", inputs), ("positions", positions), ("slots", slots)):
        _check_ids(name, t, (n, width))
    if n:
        _finish_kernel[(n,)](targets, accepted, last, first, rest if rest is not None else first,
                             tables, decided, inputs, positions, slots, targets.stride(0),
                             rest.stride(0) if rest is not None else 0, tables.stride(0),
                             decided.stride(0), inputs.stride(0), positions.stride(0),
                             slots.stride(0), block_size, K=k, BLOCK=next_power_of_2(width))
