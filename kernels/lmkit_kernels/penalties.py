"""Repetition, frequency and presence penalties of a step's rows in one pass, in place.

The sampler keeps, per request (a *slot*), an int32 ``[slots, vocab]`` table of
generated-token counts and a bool ``[slots, vocab]`` table of seen tokens (prompt and
output); a speculative step's rows also count the drafts before them (``draft_counts``,
int32 ``[P, vocab]``). The torch path spends a dozen passes over ``[P, vocab]`` on it
(gather the table rows, divide, multiply, subtract, select, scatter back); here one
program per ``(penalty row, chunk of the vocabulary)`` reads the chunk's ``seen`` bytes
(and ``draft_counts``), and only where a token is seen its count and logit, and writes
the penalised logit back: about ``P x vocab`` bytes moved instead of ~12 passes of
``P x vocab x 4``.

The arithmetic is the torch path's bit for bit (:func:`apply_penalties_ref`, the core's
``lmkit.sample.penalties.apply_penalties``): IEEE division (``div_rn``; Triton's ``/``
is approximate on the GPU) and no fused multiply-add (the launch turns fp fusion off).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import check_shape, check_tensor
from lmkit_kernels.sampling import row_chunks

__all__ = ["apply_penalties", "apply_penalties_ref"]


@triton.jit(do_not_specialize=["chunk"])
def _penalties_kernel(logits_ptr, rows_ptr, slots_ptr, counts_ptr, seen_ptr, draft_ptr,
                      rep_ptr, freq_ptr, pres_ptr, vocab, chunk, stride_logits,
                      stride_counts, stride_seen, stride_draft, HAS_DRAFTS: tl.constexpr,
                      BLOCK: tl.constexpr):
    # program (i, c): penalty row i (logits row rows[i], table row slots[i]) over the
    # vocabulary's chunk c, BLOCK tokens at a time
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i)
    slot = tl.load(slots_ptr + i)
    rep = tl.load(rep_ptr + row)
    freq = tl.load(freq_ptr + row)
    pres = tl.load(pres_ptr + row)
    start = tl.program_id(1).to(tl.int64) * chunk
    end = tl.minimum(start + chunk, vocab)
    for base in range(start, end, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        ok = offs < end
        seen = tl.load(seen_ptr + slot * stride_seen + offs, mask=ok, other=0) != 0
        if HAS_DRAFTS:
            drafted = tl.load(draft_ptr + i * stride_draft + offs, mask=ok, other=0)
            seen = seen | (drafted > 0)
        # a token generated is always seen: nothing else is read or written
        count = tl.load(counts_ptr + slot * stride_counts + offs, mask=seen, other=0)
        if HAS_DRAFTS:
            count += drafted
        at = logits_ptr + row * stride_logits + offs
        x = tl.load(at, mask=seen, other=0.0)
        x = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
        c = count.to(tl.float32)
        x = tl.where(c > 0, x - (freq * c + pres), x)
        tl.store(at, x, mask=seen)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                    counts: torch.Tensor, seen: torch.Tensor, repetition: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor,
                    draft_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Penalise ``logits`` in place, as :func:`apply_penalties_ref`.

    :param logits: float32 ``[num_rows, vocab]``, unit last stride; modified in place.
    :param rows: int64 ``[P]``, contiguous: the distinct logits rows with penalties.
    :param slots: int64 ``[P]``, contiguous: each one's row of ``counts`` and ``seen``
        (in range: not checked, that would need a device sync).
    :param counts: int32 ``[num_slots, vocab]``, unit last stride: generated tokens.
    :param seen: bool ``[num_slots, vocab]``, unit last stride: tokens seen (every
        token with a count included).
    :param repetition: float32 ``[num_rows]``, contiguous (1.0: off); ``frequency``,
        ``presence`` likewise (0.0: off).
    :param draft_counts: optional int32 ``[P, vocab]``, unit last stride: tokens
        counted (and seen) for that row alone.
    :return: ``logits``.
    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    check_tensor("logits", logits, ndim=2, dtypes=(torch.float32,), last_dim_contiguous=True)
    device = logits.device
    num_rows, vocab = logits.shape
    if vocab >= 2 ** 31:
        raise ValueError(f"vocab {vocab} is too large (max 2**31 - 1)")
    for name, t in (("rows", rows), ("slots", slots)):
        check_tensor(name, t, ndim=1, dtypes=(torch.int64,), device=device, contiguous=True)
    num_pen = rows.shape[0]
    check_shape("slots", slots, (num_pen,))
    check_tensor("counts", counts, ndim=2, dtypes=(torch.int32,), device=device,
                 last_dim_contiguous=True)
    check_shape("counts", counts, (None, vocab))
    check_tensor("seen", seen, ndim=2, dtypes=(torch.bool,), device=device,
                 last_dim_contiguous=True)
    check_shape("seen", seen, (counts.shape[0], vocab))
    for name, t in (("repetition", repetition), ("frequency", frequency),
                    ("presence", presence)):
        check_tensor(name, t, ndim=1, dtypes=(torch.float32,), device=device, contiguous=True)
        check_shape(name, t, (num_rows,))
    if draft_counts is not None:
        check_tensor("draft_counts", draft_counts, ndim=2, dtypes=(torch.int32,),
                     device=device, last_dim_contiguous=True)
        check_shape("draft_counts", draft_counts, (num_pen, vocab))
    if num_pen == 0 or vocab == 0:
        return logits
    # the sampling kernels' chunks (the chunk size is a runtime argument: one compiled
    # variant for every batch size)
    block, chunk, num_chunks = row_chunks(num_pen, vocab, device)
    drafts = counts if draft_counts is None else draft_counts  # never read when None
    _penalties_kernel[(num_pen, num_chunks)](
        logits, rows, slots, counts, seen.view(torch.uint8), drafts, repetition, frequency,
        presence, vocab, chunk, logits.stride(0), counts.stride(0), seen.stride(0),
        drafts.stride(0), HAS_DRAFTS=draft_counts is not None, BLOCK=block, num_warps=4,
        enable_fp_fusion=False)
    return logits


def apply_penalties_ref(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                        counts: torch.Tensor, seen: torch.Tensor, repetition: torch.Tensor,
                        frequency: torch.Tensor, presence: torch.Tensor,
                        draft_counts: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of :func:`apply_penalties` (same arguments), in place: for
    each row ``rows[i]`` and token seen by it (``seen[slots[i]]`` or ``draft_counts[i] >
    0``), a positive logit divided by the row's repetition penalty, a negative one
    multiplied; then, where the count (``counts[slots[i]] + draft_counts[i]``) is
    positive, ``frequency * count + presence`` subtracted. Other logits are untouched.
    """
    row_counts = counts.index_select(0, slots)
    row_seen = seen.index_select(0, slots)
    if draft_counts is not None:
        row_counts = row_counts + draft_counts
        row_seen = row_seen | (draft_counts > 0)
    before = logits.index_select(0, rows)
    rep, freq, pres = (v[rows][:, None] for v in (repetition, frequency, presence))
    c = row_counts.to(torch.float32)
    after = torch.where(before > 0, before / rep, before * rep)
    after = torch.where(c > 0, after - (freq * c + pres), after)
    logits[rows] = torch.where(row_seen, after, before)
    return logits
