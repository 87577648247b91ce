"""Draft verification pieces of the sampler: where the drafts sit among the rows, the
random rows' rejection sampling, and the all-greedy host walk.

Request ``i`` with ``k_i`` drafts owns ``k_i + 1`` consecutive rows (see
:mod:`lmkit.sample.rejection`). Seeded requests draw every random number from their own
generator (per row, in row order, then per draft), so they stay reproducible whatever
else is in the batch.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain

import numpy as np
import torch

from lmkit.api.outputs import TokenLogprob
from lmkit.api.sampling_kernels import DraftRows
from lmkit.sample import rejection
from lmkit.sample.draws import sample_from_probs


@dataclass
class VerifiedTokens:
    """Per request, the tokens to append (``num_accepted[i] + 1`` of them) and, for
    requests asking, their logprobs.

    ``no_allowed_token`` maps a request (its index) whose tokens include one drawn from
    a row whose logits were all ``-inf`` after every mask (nothing was allowed) to that
    token's index in ``token_ids[i]``: the tokens before it are valid, it and those
    after are not. Only rows the sampler checked (masks applied) are reported.
    """

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[TokenLogprob]] | None = None
    no_allowed_token: dict[int, int] = field(default_factory=dict)


class DraftLayout(DraftRows):
    """Where the drafts sit among the flat rows (host arrays turned into tensors)."""

    @classmethod
    def build(cls, drafts: Sequence[Sequence[int]], device: torch.device) -> DraftLayout:
        """The layout of ``drafts`` (per request its draft token ids)."""
        num_drafts = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))
        per_req = num_drafts + 1
        starts = np.cumsum(per_req) - per_req
        total = int(num_drafts.sum())
        req = np.repeat(np.arange(len(drafts)), num_drafts)
        pos = np.arange(total) - np.repeat(np.cumsum(num_drafts) - num_drafts, num_drafts)
        token_ids = np.fromiter(chain.from_iterable(drafts), dtype=np.int64, count=total)

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        return cls(num_drafts.tolist(), starts.tolist(), dev(starts[req] + pos), dev(token_ids),
                   dev(req), dev(pos))


def verify_greedy(logits: torch.Tensor, drafts: Sequence[Sequence[int]],
                  check_no_token: bool = False,
                  argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> VerifiedTokens:
    """Verify a step whose rows are all greedy on these logits (already adjusted, or
    needing no adjustment) and ask no logprobs: one argmax on the device, one
    device-to-host copy of the ``[num_rows]`` targets, then the accepted prefixes on the
    host (O(drafts) Python, no further device work).

    Args:
        logits: ``[num_rows, vocab]``, ``len(drafts[i]) + 1`` rows per request.
        drafts: per request its draft token ids (empty: a plain decode).
        check_no_token: also report rows whose logits are all ``-inf`` (masks were
            applied that may leave nothing), in the same copy
            (:attr:`VerifiedTokens.no_allowed_token`).
        argmax: each row's argmax, as ``torch.argmax`` gives it (the engine's
            :meth:`~lmkit.api.SamplingKernels.argmax`); ``None``, or with
            ``check_no_token`` (which needs the maxima), ``logits.max(dim=-1)``.

    Returns:
        per request the accepted drafts then the target token after them.
    """
    # max(dim).indices: the first maximal index, as argmax gives, but torch's CPU argmax
    # is ~5x slower (108 vs 22 us over a 49,152-entry row at one thread)
    if argmax is not None and not check_no_token:
        targets, no_token_rows = read_rows(argmax(logits), None)  # the one copy
    else:
        best = logits.max(dim=-1)
        targets, no_token_rows = read_rows(best.indices, best.values == float("-inf")
                                           if check_no_token else None)
    if len(targets) != len(drafts) + sum(map(len, drafts)):
        raise ValueError(f"verify_greedy got {len(targets)} logits rows for {len(drafts)} "
                         f"requests with {sum(map(len, drafts))} drafts")
    verified = accept_greedy(targets, drafts)
    if no_token_rows:
        starts = list(accumulate((len(d) + 1 for d in drafts), initial=0))[:-1]
        verified.no_allowed_token = first_no_token(no_token_rows, starts,
                                                   verified.num_accepted)
    return verified


def read_rows(values: torch.Tensor, flags: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """``values.tolist()`` (int, 1-D) and the indices where ``flags`` (bool, 1-D, or
    ``None``: none) is set, in one device-to-host copy."""
    if flags is None:
        return values.tolist(), []
    n = values.shape[0]
    host = torch.cat([values, flags.to(values.dtype)]).tolist()
    return host[:n], [row for row, flag in enumerate(host[n:]) if flag]


def first_no_token(rows: Iterable[int], row_starts: Sequence[int],
                   num_accepted: Sequence[int]) -> dict[int, int]:
    """Per request (index) whose emitted tokens include one drawn at a row of ``rows``
    (ascending; rows where nothing was allowed), the position of the first such token:
    request ``i`` emits its rows ``row_starts[i]`` to ``row_starts[i] + num_accepted[i]``;
    its later rows (after a rejected draft) are not output and do not count."""
    at: dict[int, int] = {}
    for row in rows:
        i = bisect_right(row_starts, row) - 1
        position = row - row_starts[i]
        if i not in at and position <= num_accepted[i]:
            at[i] = position
    return at


def accept_greedy(targets: list[int], drafts: Sequence[Sequence[int]]) -> VerifiedTokens:
    """The accepted prefix of each request's drafts given the target's greedy token at
    every row (``len(drafts[i]) + 1`` rows per request, in order), and the target token
    after it (the correction at the first mismatch, else the bonus row's)."""
    token_ids, num_accepted = [], []
    start = 0
    for draft in drafts:
        k = len(draft)
        accepted = 0
        while accepted < k and draft[accepted] == targets[start + accepted]:
            accepted += 1
        # accepted drafts equal the targets at their rows: emit targets up to the
        # first mismatch (its target is the correction) or the bonus row
        token_ids.append(targets[start:start + accepted + 1])
        num_accepted.append(accepted)
        start += k + 1
    return VerifiedTokens(token_ids, num_accepted)


def sample_and_accept(probs: torch.Tensor, generators: dict[int, torch.Generator],
                      layout: DraftRows, draft_probs: Sequence[torch.Tensor | None] | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for the random rows of ``probs`` (``[num_rows, vocab]``, the
    target distributions): (row tokens, accepted per draft). Rows in ``generators``
    (seeded requests, by their first row) draw only from their own generator."""
    device, vocab = probs.device, probs.shape[1]
    q_rows, q, q_at_draft = None, None, torch.ones(len(layout.rows), device=device)
    if draft_probs is not None and any(p is not None for p in draft_probs):
        q_rows, q = _gather_draft_probs(draft_probs, layout, vocab, device)
        draft_first = np.cumsum(layout.num_drafts) - np.asarray(layout.num_drafts)
        idx = [np.arange(draft_first[i], draft_first[i] + n)
               for i, (n, p) in enumerate(zip(layout.num_drafts, draft_probs, strict=True))
               if p is not None and n]
        q_idx = torch.from_numpy(np.concatenate(idx)).to(device)
        q_at_draft[q_idx] = q.gather(1, layout.token_ids[q_idx].unsqueeze(1)).squeeze(1)
    weights = rejection.recovery_weights(probs, layout.rows, layout.token_ids, q_rows, q)
    row_tokens = sample_from_probs(weights, generators)
    uniform = torch.rand(len(layout.rows), device=device)
    seeded_uniforms(uniform, generators, layout.row_starts, layout.num_drafts)
    accepted = rejection.accept_probabilistic(probs, layout.rows, layout.token_ids,
                                              q_at_draft, uniform)
    return row_tokens, accepted


def logprobs_per_request(row_logprobs: list[TokenLogprob | None], layout: DraftRows,
                         num_accepted: list[int]) -> list[list[TokenLogprob]]:
    """Each request's logprobs for the tokens it emits (its first ``n + 1`` rows)."""
    return [[lp for lp in row_logprobs[s:s + n + 1] if lp is not None]
            for s, n in zip(layout.row_starts, num_accepted, strict=True)]


def _gather_draft_probs(draft_probs: Sequence[torch.Tensor | None], layout: DraftRows,
                        vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows with draft distributions and those distributions, ``[num_q, vocab]``."""
    rows, blocks = [], []
    for start, n, p in zip(layout.row_starts, layout.num_drafts, draft_probs, strict=True):
        if p is None or n == 0:
            continue
        if p.dim() != 2 or p.shape[0] < n or p.shape[1] > vocab:
            raise ValueError(f"draft_probs of shape {tuple(p.shape)} for {n} drafts: expected "
                             f"[{n}, vocab <= {vocab}] (one distribution per draft)")
        block = p[:n].to(device=device, dtype=torch.float32)
        if block.shape[1] < vocab:  # a draft vocabulary that is a prefix of the target's
            block = torch.nn.functional.pad(block, (0, vocab - block.shape[1]))
        rows.append(torch.arange(start, start + n))
        blocks.append(block)
    return torch.cat(rows).to(device), torch.cat(blocks)


def seeded_uniforms(uniform: torch.Tensor, generators: Mapping[int, torch.Generator],
                    row_starts: Sequence[int], num_drafts: Sequence[int]) -> None:
    """Redraw the acceptance uniforms (one per draft, request after request) of seeded
    requests from their own generators (``generators`` keyed by a request's first row,
    ``row_starts``)."""
    if not generators:
        return
    first = 0
    for start, n in zip(row_starts, num_drafts, strict=True):
        gen = generators.get(start)
        if gen is not None and n:
            uniform[first:first + n] = torch.rand(n, generator=gen, device=gen.device).to(
                uniform.device)
        first += n
