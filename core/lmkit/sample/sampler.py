"""The sampler: a step's logits -> the tokens each request emits, drafts verified.

One pipeline for every step. The logits have one row per position a request samples
at: one for a plain decode (or the last chunk of a prefill), ``k + 1`` consecutive rows
for a request with ``k`` draft tokens (its parameters repeated, its output extended by
the drafts before each position, see :class:`~lmkit.sample.metadata.SamplingMetadata`).
All batched:

1. raw logprobs (rows asking), from the model's logits;
2. :func:`~lmkit.sample.draws.adjust_logits` on a float32 copy: logit bias, token bans
   (min_tokens, bad_words), allowed token ids, penalties (by the engine's
   :class:`~lmkit.api.SamplingKernels`, ``apply_penalties``), plugin logits processors;
3. greedy rows: argmax; random rows: one draw per row (temperature, min-p, top-k,
   top-p) by the engine's :class:`~lmkit.api.SamplingKernels` (``sample``); where the
   masks of step 2 may leave nothing (:attr:`~lmkit.sample.metadata.SamplingMetadata.
   may_allow_no_token`), which rows have every logit ``-inf``: their draw is garbage,
   reported with the tokens in the same device-to-host copy
   (:attr:`VerifiedTokens.no_allowed_token`);
4. only with drafts: the acceptance rule (greedy: the draft equals the argmax; random:
   :func:`~lmkit.sample.draws.compute_probs` then rejection sampling by the sampling
   kernels (``verify``): draws at draft rows come from the recovery distribution, see
   :mod:`lmkit.sample.rejection`), then the accepted prefix per request.

The sampling kernels are the core's torch ones
(:class:`~lmkit.sample.kernels.TorchSamplingKernels`) unless the engine chose a plugin's
(the ``sampling_kernels`` kind, e.g. the Triton ones on CUDA).

"No drafts" is the simple case: step 4 is skipped and each row's draw is its token. A
step whose rows are all greedy and ask no logprobs (the common case of a copy workload)
takes a shorter path, :func:`~lmkit.sample.drafts.verify_greedy`: one argmax, one
device-to-host copy, the accepted prefixes found on the host. The model runner calls it
directly, without building sampling metadata, when no request needs its logits adjusted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmkit.api.outputs import TokenLogprob
from lmkit.api.sampling_kernels import SamplingKernels
from lmkit.sample import rejection
from lmkit.sample.drafts import (
    DraftLayout,
    VerifiedTokens,
    first_no_token,
    logprobs_per_request,
    read_rows,
    verify_greedy,
)
from lmkit.sample.draws import adjust_logits, compute_probs, make_generator, sample_from_probs
from lmkit.sample.kernels import TorchSamplingKernels, random_rows
from lmkit.sample.logprobs import compute_prompt_logprobs, to_token_logprobs
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.row_cache import SamplingCache

__all__ = [
    "Sampler", "SamplerOutput", "VerifiedTokens", "adjust_logits", "compute_probs", "row_logprobs",
    "compute_prompt_logprobs", "make_generator", "sample_from_probs", "verify_greedy",
]


@dataclass
class SamplerOutput:
    """The sampled token per row and, for rows that asked, its logprobs; where the
    step's masks may leave nothing, which rows had every logit ``-inf`` (their token is
    garbage)."""

    sampled_token_ids: torch.Tensor  # int64 [num_rows]
    logprobs: list[TokenLogprob | None] | None  # per row; None when no row asks
    no_allowed_token: torch.Tensor | None = None  # bool [num_rows]; None: not checked


class Sampler:
    """Samples a step's rows and verifies its drafts (see the module docstring), the
    random draws by ``kernels`` (default: the core's torch ones)."""

    def greedy_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (int64, on the logits' device): this sampler's ``kernels``'
        on CUDA; on the CPU ``logits.max``, several times faster than ``torch.argmax``
        there and the same index."""
        if logits.device.type == "cuda":
            return self.kernels.argmax(logits)
        return logits.max(dim=-1).indices

    def verify_greedy(self, logits: torch.Tensor, drafts: Sequence[Sequence[int]],
                      check_no_token: bool = False) -> VerifiedTokens:
        """:func:`~lmkit.sample.drafts.verify_greedy` with :meth:`greedy_ids`."""
        return verify_greedy(logits, drafts, check_no_token, self.greedy_ids)

    def __init__(self, kernels: SamplingKernels | None = None) -> None:
        self.kernels = kernels if kernels is not None else TorchSamplingKernels(device=None)
        self._requests: SamplingCache | None = None

    def request_cache(self, vocab_size: int, device: torch.device) -> SamplingCache:
        """The per-request tensors kept across steps (logit bias, allowed ids, penalty
        counts) for logits of ``vocab_size`` on ``device``; made on first use."""
        cache = self._requests
        if cache is None or cache.vocab_size != vocab_size or cache.device != device:
            cache = self._requests = SamplingCache(vocab_size, device)
        return cache

    def forget(self, req_id: str) -> None:
        """Drop what :meth:`request_cache` keeps for ``req_id`` (finished, preempted)."""
        if self._requests is not None:
            self._requests.forget(req_id)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` (float32 ``[num_rows, vocab]``, left
        unmodified): a step without drafts.

        Greedy rows are exactly ``torch.argmax`` of the adjusted logits (first index on
        ties). Logprobs, for rows asking, are from the raw logits.
        """
        _check_rows(logits, md, md.num_rows, "one row per request")
        tokens, _, raw_logprobs, no_token = self._sample_rows(logits, md, None, None)
        return SamplerOutput(tokens, row_logprobs(tokens, raw_logprobs, md), no_token)

    def sample_requests(self, logits: torch.Tensor, md: SamplingMetadata,
                        drafts: Sequence[Sequence[int]],
                        draft_probs: Sequence[torch.Tensor | None] | None = None
                        ) -> VerifiedTokens:
        """Sample every request's next token, verifying its drafts first.

        Args:
            logits: ``[num_rows, vocab]``, ``len(drafts[i]) + 1`` consecutive rows per
                request; not modified.
            md: one row per logits row.
            drafts: per request its draft token ids (empty: a plain decode or the last
                prefill chunk).
            draft_probs: per request ``[len(drafts[i]), vocab]`` draft distributions, or
                ``None`` (deterministic drafts, one-hot).

        Returns:
            per request the accepted drafts then one sampled token, and which of them
            came from a row where nothing was allowed (``no_allowed_token``).
        """
        if not any(drafts):
            out = self(logits, md)
            tokens, no_token_rows = read_rows(out.sampled_token_ids, out.no_allowed_token)
            lps = None if out.logprobs is None else [[lp] if lp else [] for lp in out.logprobs]
            return VerifiedTokens([[t] for t in tokens], [0] * len(tokens), lps,
                                  dict.fromkeys(no_token_rows, 0))
        _check_rows(logits, md, len(drafts) + sum(map(len, drafts)),
                    "one row per draft plus one per request")
        if md.all_greedy and md.logprob_rows is None:
            if md.needs_logit_adjustment:
                logits = adjust_logits(logits.to(torch.float32, copy=True), md, self.kernels)
            return self.verify_greedy(logits, drafts, md.may_allow_no_token)
        layout = DraftLayout.build(drafts, logits.device)
        out_tokens, accepted, raw_logprobs, no_token = self._sample_rows(logits, md, layout,
                                                                         draft_probs)
        assert accepted is not None
        num_accepted = rejection.count_accepted(accepted, layout.req, layout.pos, len(drafts),
                                                max(layout.num_drafts))
        # the one device-to-host copy
        host, no_token_rows = read_rows(torch.cat([out_tokens, num_accepted]), no_token)
        rows_out, accepted_l = host[:md.num_rows], host[md.num_rows:]
        token_ids = [rows_out[s:s + n + 1] for s, n in zip(layout.row_starts, accepted_l,
                                                             strict=True)]
        row_lps = row_logprobs(out_tokens, raw_logprobs, md)
        logprobs = None if row_lps is None else logprobs_per_request(row_lps, layout,
                                                                      accepted_l)
        return VerifiedTokens(token_ids, accepted_l, logprobs,
                              first_no_token(no_token_rows, layout.row_starts, accepted_l))

    def _sample_rows(self, logits: torch.Tensor, md: SamplingMetadata,
                     layout: DraftLayout | None, draft_probs: Sequence[torch.Tensor | None] | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                torch.Tensor | None]:
        """Steps 1-4 on the device: (each row's output token if the request reaches
        it, accepted per draft or ``None`` without drafts, raw logprobs of the rows
        asking or ``None``, which rows had nothing allowed or ``None`` when no mask
        could leave nothing)."""
        raw_logprobs = None
        if md.logprob_rows is not None:
            raw_logprobs = logits[md.logprob_rows].float().log_softmax(dim=-1)
        if md.needs_logit_adjustment or not md.all_greedy:
            logits = adjust_logits(logits.to(torch.float32, copy=True), md, self.kernels)
        # before the draws, which may filter the logits in place
        no_token = logits.amax(dim=-1) == float("-inf") if md.may_allow_no_token else None
        greedy_ids = None if md.all_random else self.kernels.argmax(logits)
        accepted = None
        if md.all_greedy:
            assert greedy_ids is not None
            row_tokens = greedy_ids
            if layout is not None:
                accepted = layout.token_ids == greedy_ids[layout.rows]
        elif layout is None:
            row_tokens = self.kernels.sample(logits, random_rows(md))
        else:
            row_tokens, accepted = self.kernels.verify(compute_probs(logits, md),
                                                       random_rows(md), layout, draft_probs)
        if greedy_ids is not None and not md.all_greedy:
            row_tokens = torch.where(md.is_greedy, greedy_ids, row_tokens)
            if layout is not None and accepted is not None:
                accepted = torch.where(md.is_greedy[layout.rows],
                                       layout.token_ids == greedy_ids[layout.rows], accepted)
        if layout is not None and accepted is not None:
            row_tokens = rejection.select_output_tokens(row_tokens, layout.rows,
                                                        layout.token_ids, accepted)
        return row_tokens, accepted, raw_logprobs, no_token


def _check_rows(logits: torch.Tensor, md: SamplingMetadata, num_rows: int, what: str) -> None:
    if logits.dim() != 2 or logits.shape[0] != md.num_rows or md.num_rows != num_rows:
        raise ValueError(f"Sampler expects logits [num_rows={num_rows}, vocab] and metadata "
                         f"with {what}; got logits {tuple(logits.shape)}, metadata "
                         f"{md.num_rows} rows")


def row_logprobs(tokens: torch.Tensor, raw_logprobs: torch.Tensor | None,
                  md: SamplingMetadata) -> list[TokenLogprob | None] | None:
    """Per row its token's logprobs (rows asking) or ``None``; ``None`` if no row asks."""
    if raw_logprobs is None or md.logprob_rows is None:
        return None
    rows = [i for i, n in enumerate(md.num_logprobs) if n is not None]
    entries = to_token_logprobs(tokens[md.logprob_rows], raw_logprobs,
                                [md.num_logprobs[i] or 0 for i in rows])
    per_row: list[TokenLogprob | None] = [None] * md.num_rows
    for row, entry in zip(rows, entries, strict=True):
        per_row[row] = entry
    return per_row
