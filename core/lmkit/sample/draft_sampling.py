"""Sampled drafts of a draft head: one token per row from the head's distribution after
the request's own temperature, min-p, top-k and top-p, on the device.

Rejection sampling (:mod:`lmkit.sample.rejection`) keeps the output distribution the
target's for *any* draft distribution ``q``, as long as the ``q`` handed to
verification is the one the draft was drawn from; the closer ``q`` is to the target's
``p``, the more drafts are accepted. So a draft head samples from its logits filtered
like the target's (not its argmax) for the requests that sample, and hands ``q`` on.

What :func:`sample_draft_tokens` applies, per row: temperature, then min-p, top-k and
top-p (in the target's order, :mod:`lmkit.sample.filters`) among the head's
:data:`NUM_DRAFT_CANDIDATES` most likely tokens, which bounds every shape (no sort of
the whole vocabulary, no host synchronisation: the function may be captured in a CUDA
graph). ``q`` is that filtered distribution renormalised over the kept candidates:
exactly the target's filters when the kept set lies among the candidates (any top-k up
to the candidate count, every nucleus that fits), a truncation of it otherwise. Not
applied: logit bias, banned and allowed tokens, penalties, plugin logits processors and
grammars (they need per-request host state); they can only lower acceptance, never
change the output distribution. Rows with temperature 0 take the argmax (greedy rows).

Randomness: one uniform per row (inverse-CDF draw, as
:func:`lmkit.sample.draws.sample_from_probs`), drawn before the passes by
:func:`draw_draft_uniforms`: ``k`` per drafting request and step, seeded requests from
their own generator, so their outputs stay reproducible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

#: how many of the head's most likely tokens a sampled draft is drawn among
NUM_DRAFT_CANDIDATES = 256


@dataclass(frozen=True)
class DraftRowParams:
    """Per draft row its request's filters and this pass's uniform (device tensors
    ``[n]``, the arguments of :func:`sample_draft_tokens`)."""

    temperature: torch.Tensor  # float32; 0: a greedy row (argmax)
    top_k: torch.Tensor  # int64; <= 0: off
    top_p: torch.Tensor  # float32; 1: off
    min_p: torch.Tensor  # float32; 0: off
    uniform: torch.Tensor  # float32 in [0, 1)

    @classmethod
    def from_params(cls, params: Sequence[object], device: torch.device) -> DraftRowParams:
        """Rows for ``params`` (:class:`~lmkit.api.SamplingParams`, greedy or not),
        uniforms zero (:meth:`with_uniform` sets them)."""
        def col(name: str, dtype: torch.dtype) -> torch.Tensor:
            values = np.array([getattr(p, name) for p in params])
            return torch.from_numpy(values).to(device=device, dtype=dtype, non_blocking=True)

        temperature = col("temperature", torch.float32)
        return cls(temperature, col("top_k", torch.int64), col("top_p", torch.float32),
                   col("min_p", torch.float32), torch.zeros_like(temperature))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in :func:`sample_draft_tokens`' argument order."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def select(self, index: torch.Tensor, uniform: torch.Tensor) -> DraftRowParams:
        """Rows ``index`` (device int64) with ``uniform`` (``[len(index)]``) as theirs."""
        return DraftRowParams(self.temperature.index_select(0, index),
                              self.top_k.index_select(0, index),
                              self.top_p.index_select(0, index),
                              self.min_p.index_select(0, index), uniform)

    def head(self, n: int) -> DraftRowParams:
        """The first ``n`` rows (views)."""
        return DraftRowParams(self.temperature[:n], self.top_k[:n], self.top_p[:n],
                              self.min_p[:n], self.uniform[:n])

    def scatter(self, index: torch.Tensor, num_rows: int, uniform: torch.Tensor
                ) -> DraftRowParams:
        """``num_rows`` greedy rows, these rows placed at ``index`` (with ``uniform``)."""
        out = DraftRowParams.greedy(num_rows, self.temperature.device)
        for dst, src in zip(out.tensors(), (*self.tensors()[:4], uniform), strict=True):
            dst.index_copy_(0, index, src)
        return out

    @classmethod
    def greedy(cls, num_rows: int, device: torch.device) -> DraftRowParams:
        """``num_rows`` greedy rows (temperature 0, filters off)."""
        def full(value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((num_rows,), value, dtype=dtype, device=device)

        return cls(full(0, torch.float32), full(0, torch.int64), full(1, torch.float32),
                   full(0, torch.float32), full(0, torch.float32))


def sample_draft_tokens(logits: torch.Tensor, target_ids: torch.Tensor | None,
                        rows: DraftRowParams, num_candidates: int = NUM_DRAFT_CANDIDATES
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one draft per row of the head's ``logits`` (see the module docstring).

    Args:
        logits: float32 ``[n, draft vocab]`` (``-inf``: never drafted).
        target_ids: int64 ``[draft vocab]``, the target id of each draft id; ``None``:
            the draft vocabulary is the target's.
        rows: each row's temperature (0 takes the argmax; the row's ``q`` is then
            unused), top-k (``<= 0`` or ``>=`` the candidate count: off), top-p in
            ``(0, 1]``, min-p in ``[0, 1]`` and uniform in ``[0, 1)``, ``[n]`` each.
        num_candidates: candidates per row (at most the draft vocabulary).

    Returns:
        ``(ids [n], candidate_ids [n, c], q [n, c])``: the drafts and each row's
        distribution over its candidates, all as target ids (rows sum to 1; a greedy
        row's ``q`` is that of temperature 1).
    """
    c = min(num_candidates, logits.shape[1])
    temperature, top_k, top_p, min_p = rows.temperature, rows.top_k, rows.top_p, rows.min_p
    greedy = temperature <= 0
    argmax = logits.argmax(dim=-1)
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    lse = scaled.logsumexp(dim=-1, keepdim=True)  # [n, 1]
    top, cand = scaled.topk(c, dim=-1)  # [n, c], descending
    p = (top - lse).exp()  # each candidate's probability over the whole vocabulary
    rank = torch.arange(c, device=logits.device)
    k = torch.where(top_k > 0, top_k, c)
    keep = (rank < k.unsqueeze(1)) & (p >= p[:, :1] * min_p.unsqueeze(1))
    p = p * keep
    # top-p on the distribution left by min-p and top-k: the mass before each candidate
    before = (p.cumsum(dim=-1) - p) / p.sum(dim=-1, keepdim=True)
    q = p * (before < top_p.unsqueeze(1))
    q = q / q.sum(dim=-1, keepdim=True)  # the top candidate is always kept
    cdf = q.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(rows.uniform.unsqueeze(1) * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=c - 1)  # [n, 1]
    ids = torch.where(greedy, argmax, cand.gather(1, pick).squeeze(1))
    if target_ids is not None:
        ids, cand = target_ids[ids], target_ids[cand]
    return ids, cand, q


def draw_draft_uniforms(num_rows: int, k: int, generators: Mapping[int, torch.Generator],
                        device: torch.device) -> torch.Tensor:
    """float32 ``[num_rows, k]`` uniforms for ``k`` draft passes: rows in ``generators``
    (seeded requests) draw their ``k`` from their own generator, the others share one
    draw from the default generator."""
    u = torch.empty(num_rows, k, dtype=torch.float32, device=device)
    if len(generators) < num_rows:
        u.uniform_()
    for row, generator in generators.items():
        u[row] = torch.rand(k, generator=generator, device=generator.device).to(device)
    return u


def candidates_to_dense(cand: torch.Tensor, q: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[n, c]`` candidate ids and probabilities -> float32 ``[n, vocab_size]`` (0
    outside the candidates; a target id reached by two draft ids gets both masses)."""
    dense = torch.zeros(cand.shape[0], vocab_size, dtype=torch.float32, device=q.device)
    return dense.scatter_add_(1, cand, q.float())
