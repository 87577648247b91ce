"""Speculative-decoding verification on the GPU: greedy prefix acceptance and rejection
sampling in two Triton launches, with :func:`rejection_sample_ref` as the reference.

Row layout (the engine's): request ``i`` with ``k_i`` drafts owns ``k_i + 1``
consecutive rows of ``target_probs``; row ``j < k_i`` is the target distribution at
draft ``j``, the last row the bonus position. Drafts are flat, ``cu_num_drafts[i]`` the
end of request ``i``'s.

1. ``_row_sample_kernel``, one program per (request, position): the token each row
   emits if the output reaches it. Greedy requests: ``argmax(p)``. Random requests,
   by the exponential race ``argmax(w / E)`` with ``E ~ Exp(1)`` from ``noise``: a draft
   row draws from ``w = max(0, p - q)`` (``q`` one-hot at the draft when no
   ``draft_probs``: ``p`` with the draft zeroed), the bonus row from ``w = p``. The
   vocabulary is scanned in blocks, keeping the first maximum.
2. ``_accept_kernel``, one program per request: walks its drafts; a greedy draft passes
   when it equals the row's argmax, a random one when ``u * q(d) < p(d)``; writes the
   accepted drafts, then the first rejected row's token, or the bonus token.

Output: ``[num_reqs, max_num_drafts + 1]`` token ids, ``-1`` after each request's last,
and the number of accepted drafts per request. With the same ``uniform`` and ``noise``
the reference gives exactly the same result; the emitted tokens follow the target
distribution whatever ``q`` was (Leviathan et al. 2023).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import check_shape, check_tensor, next_power_of_2

__all__ = ["rejection_sample", "rejection_sample_ref"]

PLACEHOLDER = -1


@triton.jit
def _row_sample_kernel(target_ptr, target_stride, draft_ids_ptr, cu_ptr, greedy_ptr,
                       q_ptr, q_stride, noise_ptr, noise_stride, row_tokens_ptr, vocab,
                       HAS_GREEDY: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
    req = tl.program_id(0)
    j = tl.program_id(1)
    d_end = tl.load(cu_ptr + req).to(tl.int64)
    d_start = tl.load(cu_ptr + req - 1, mask=req > 0, other=0).to(tl.int64)
    k = d_end - d_start
    if j > k:
        return
    row = d_start + req + j
    is_draft = j < k
    draft = tl.load(draft_ids_ptr + d_start + j, mask=is_draft, other=-1).to(tl.int64)
    greedy = False
    if HAS_GREEDY:
        greedy = tl.load(greedy_ptr + req) != 0
    best_val = -2.0
    best_idx = 0
    for off in range(0, vocab, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < vocab
        p = tl.load(target_ptr + row * target_stride + cols, mask=mask, other=0.0)
        w = p
        if HAS_Q:
            q_row = tl.where(is_draft, d_start + j, 0)  # bonus rows read (and drop) row 0
            q = tl.load(q_ptr + q_row * q_stride + cols, mask=mask, other=0.0)
            w = tl.where(is_draft, tl.maximum(p - q, 0.0), p)
        else:
            w = tl.where(cols == draft, 0.0, p)
        e = tl.load(noise_ptr + row * noise_stride + cols, mask=mask, other=1.0)
        race = w / tl.maximum(e, 1.1754943508222875e-38)
        score = tl.where(mask, tl.where(greedy, p, race), -1.0)
        blk_max = tl.max(score, axis=0)
        blk_idx = tl.argmax(score, axis=0)
        better = blk_max > best_val
        best_idx = tl.where(better, off + blk_idx, best_idx)
        best_val = tl.where(better, blk_max, best_val)
    tl.store(row_tokens_ptr + row, best_idx.to(tl.int64))


@triton.jit
def _accept_kernel(target_ptr, target_stride, draft_ids_ptr, cu_ptr, greedy_ptr, q_ptr,
                   q_stride, uniform_ptr, row_tokens_ptr, out_ptr, out_stride, num_acc_ptr,
                   HAS_GREEDY: tl.constexpr, HAS_Q: tl.constexpr):
    req = tl.program_id(0)
    d_end = tl.load(cu_ptr + req).to(tl.int64)
    d_start = tl.load(cu_ptr + req - 1, mask=req > 0, other=0).to(tl.int64)
    k = d_end - d_start
    greedy = False
    if HAS_GREEDY:
        greedy = tl.load(greedy_ptr + req) != 0
    alive = 1
    num_acc = 0
    for j in range(0, k):
        row = d_start + req + j
        draft = tl.load(draft_ids_ptr + d_start + j).to(tl.int64)
        token = tl.load(row_tokens_ptr + row)
        p_d = tl.load(target_ptr + row * target_stride + draft)
        q_d = 1.0
        if HAS_Q:
            q_d = tl.load(q_ptr + (d_start + j) * q_stride + draft)
        u = tl.load(uniform_ptr + d_start + j)
        accept = tl.where(greedy, draft == token, u * q_d < p_d)
        tl.store(out_ptr + req * out_stride + j, tl.where(accept, draft, token), mask=alive == 1)
        num_acc += tl.where((alive == 1) & accept, 1, 0)
        alive = tl.where(accept, alive, 0)
    bonus = tl.load(row_tokens_ptr + d_start + req + k)
    tl.store(out_ptr + req * out_stride + k, bonus, mask=alive == 1)
    tl.store(num_acc_ptr + req, num_acc.to(tl.int64))


def _check(target_probs, draft_token_ids, cu_num_drafts, uniform, noise, is_greedy,
           draft_probs) -> tuple[int, int, int]:
    check_tensor("target_probs", target_probs, ndim=2, dtypes=(torch.float32,),
                 last_dim_contiguous=True)
    device = target_probs.device
    num_rows, vocab = target_probs.shape
    check_tensor("draft_token_ids", draft_token_ids, ndim=1,
                 dtypes=(torch.int32, torch.int64), device=device, contiguous=True)
    check_tensor("cu_num_drafts", cu_num_drafts, ndim=1, dtypes=(torch.int32, torch.int64),
                 device=device, contiguous=True)
    num_drafts, num_reqs = draft_token_ids.shape[0], cu_num_drafts.shape[0]
    if num_rows != num_drafts + num_reqs:
        raise ValueError(f"target_probs has {num_rows} rows; expected one per draft plus one "
                         f"per request ({num_drafts} + {num_reqs})")
    check_tensor("uniform", uniform, ndim=1, dtypes=(torch.float32,), device=device,
                 contiguous=True)
    check_shape("uniform", uniform, (num_drafts,))
    check_tensor("noise", noise, ndim=2, dtypes=(torch.float32,), device=device,
                 last_dim_contiguous=True)
    check_shape("noise", noise, (num_rows, vocab))
    if is_greedy is not None:
        check_tensor("is_greedy", is_greedy, ndim=1, dtypes=(torch.bool,), device=device,
                     contiguous=True)
        check_shape("is_greedy", is_greedy, (num_reqs,))
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, ndim=2, dtypes=(torch.float32,),
                     device=device, last_dim_contiguous=True)
        check_shape("draft_probs", draft_probs, (num_drafts, vocab))
    return num_reqs, num_drafts, vocab


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     cu_num_drafts: torch.Tensor, uniform: torch.Tensor, noise: torch.Tensor,
                     max_num_drafts: int, is_greedy: torch.Tensor | None = None,
                     draft_probs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every request's drafts and draw its next token (see the module docstring).

    :param target_probs: float32 ``[num_drafts + num_reqs, vocab]`` target distributions
        (greedy requests' rows: any distribution whose argmax is the target token).
    :param draft_token_ids: int32/int64 ``[num_drafts]``.
    :param cu_num_drafts: int32/int64 ``[num_reqs]``, cumulative draft counts.
    :param uniform: float32 ``[num_drafts]`` in ``[0, 1)``, one acceptance test each.
    :param noise: float32 ``[num_rows, vocab]`` Exp(1) draws for the exponential race.
    :param max_num_drafts: the largest ``k_i`` (sizes the output without a host sync).
    :param is_greedy: bool ``[num_reqs]``; ``None``: every request samples.
    :param draft_probs: float32 ``[num_drafts, vocab]`` draft distributions; ``None``:
        every draft is deterministic (one-hot).
    :return: ``(output_token_ids int64 [num_reqs, max_num_drafts + 1]`` with ``-1``
        padding, ``num_accepted int64 [num_reqs])``.
    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    num_reqs, _, vocab = _check(target_probs, draft_token_ids, cu_num_drafts, uniform, noise,
                                is_greedy, draft_probs)
    device = target_probs.device
    out = torch.full((num_reqs, max_num_drafts + 1), PLACEHOLDER, dtype=torch.int64,
                     device=device)
    num_accepted = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    if num_reqs == 0:
        return out, num_accepted
    row_tokens = torch.empty(target_probs.shape[0], dtype=torch.int64, device=device)
    greedy = is_greedy if is_greedy is not None else row_tokens  # unused when absent
    has_q = draft_probs is not None and draft_probs.shape[0] > 0
    q = draft_probs if has_q else target_probs  # unused when absent
    block = min(next_power_of_2(vocab), 4096)
    _row_sample_kernel[(num_reqs, max_num_drafts + 1)](
        target_probs, target_probs.stride(0), draft_token_ids, cu_num_drafts, greedy,
        q, q.stride(0), noise, noise.stride(0), row_tokens, vocab,
        HAS_GREEDY=is_greedy is not None, HAS_Q=has_q, BLOCK=block)
    _accept_kernel[(num_reqs,)](
        target_probs, target_probs.stride(0), draft_token_ids, cu_num_drafts, greedy, q,
        q.stride(0), uniform, row_tokens, out, out.stride(0), num_accepted,
        HAS_GREEDY=is_greedy is not None, HAS_Q=has_q)
    return out, num_accepted


def rejection_sample_ref(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                         cu_num_drafts: torch.Tensor, uniform: torch.Tensor,
                         noise: torch.Tensor, max_num_drafts: int,
                         is_greedy: torch.Tensor | None = None,
                         draft_probs: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`rejection_sample`: one request at a time, the
    textbook algorithm, same arguments and results."""
    _check(target_probs, draft_token_ids, cu_num_drafts, uniform, noise, is_greedy,
           draft_probs)
    num_reqs = cu_num_drafts.shape[0]
    out = torch.full((num_reqs, max_num_drafts + 1), PLACEHOLDER, dtype=torch.int64)
    num_accepted = torch.zeros(num_reqs, dtype=torch.int64)
    tiny = torch.finfo(torch.float32).tiny
    ends = cu_num_drafts.tolist()
    for i in range(num_reqs):
        start = ends[i - 1] if i else 0
        k = ends[i] - start
        greedy = bool(is_greedy[i]) if is_greedy is not None else False
        for j in range(k + 1):
            row = start + i + j
            p = target_probs[row].cpu()
            if greedy:
                token = int(p.argmax())
            else:
                if j < k:  # a draft row: the residual distribution
                    d = int(draft_token_ids[start + j])
                    if draft_probs is not None:
                        w = (p - draft_probs[start + j].cpu()).clamp_min(0.0)
                    else:
                        w = p.clone()
                        w[d] = 0.0
                else:
                    w = p
                token = int((w / noise[row].cpu().clamp_min(tiny)).argmax())
            if j == k:
                out[i, j] = token  # every draft accepted: the bonus token
                break
            d = int(draft_token_ids[start + j])
            q_d = float(draft_probs[start + j, d]) if draft_probs is not None else 1.0
            accept = d == token if greedy else float(uniform[start + j]) * q_d < float(p[d])
            if not accept:
                out[i, j] = token
                break
            out[i, j] = d
            num_accepted[i] += 1
    return out.to(target_probs.device), num_accepted.to(target_probs.device)
