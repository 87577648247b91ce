"""Per-step sampling metadata: every request's sampling parameters as batch tensors.

Built once per step by the model runner (O(batch) Python work; what a request's logit
bias, allowed ids and penalties need is kept across steps by the runner's
:class:`~lmkit.sample.row_cache.SamplingCache`, which adds only each step's new tokens),
then consumed by :class:`lmkit.sample.sampler.Sampler`
without any per-row Python. Fields a step does not need are ``None`` so the sampler
skips that work entirely.

Speculative decoding verifies several positions per request: build the metadata with
one row per position (the request's params repeated, its output ids extended by the
drafts before that position), then :func:`lmkit.sample.sampler.adjust_logits` and
:func:`lmkit.sample.sampler.compute_probs` give the target distribution of every row.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lmkit.api.sampling_kernels import PenaltyRows
from lmkit.api.sampling_params import SamplingParams
from lmkit.sample.penalties import build_penalty_tensors
from lmkit.sample.row_cache import SamplingCache, upload

if TYPE_CHECKING:
    from lmkit.api.logits_processor import LogitsProcessor


@dataclass
class SamplingMetadata:
    """One row per request that samples a token this step.

    Greedy rows (``temperature == 0``) carry neutral values in the random-sampling
    tensors (temperature 1.0, filters off); they take the argmax of the adjusted logits.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    is_greedy: torch.Tensor  # bool [num_rows]
    # Random sampling; None when all rows are greedy or no row uses the filter.
    temperature: torch.Tensor | None  # float32 [num_rows]
    top_k: torch.Tensor | None  # int64 [num_rows]; >= vocab_size means off
    max_top_k: int  # largest active top_k (0 when top_k is None)
    top_p: torch.Tensor | None  # float32 [num_rows]; 1.0 means off
    min_p: torch.Tensor | None  # float32 [num_rows]; 0.0 means off
    # Row -> that request's own generator (seeded, random rows only).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # logit_bias as flat (row, token id, value) entries.
    bias_rows: torch.Tensor | None = None  # int64 [num_entries]
    bias_token_ids: torch.Tensor | None = None  # int64 [num_entries]
    bias_values: torch.Tensor | None = None  # float32 [num_entries]
    # (row, token id) pairs forbidden this step: EOS and stop_token_ids below min_tokens,
    # bad_words whose preceding tokens match the output.
    banned_rows: torch.Tensor | None = None  # int64 [num_banned]
    banned_token_ids: torch.Tensor | None = None  # int64 [num_banned]
    # allowed_token_ids: the rows that have it and, per such row, the tokens allowed.
    allowed_rows: torch.Tensor | None = None  # int64 [num_allowed_rows]
    allowed_mask: torch.Tensor | None = None  # bool [num_allowed_rows, vocab]
    # repetition / frequency / presence penalties (the kept tables, each row's slot)
    penalties: PenaltyRows | None = None
    # Plugin logits processors in use this step, and each row's request slot.
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    processor_slots: torch.Tensor | None = None  # int64 [num_rows]
    # Logprobs: per-row count of alternatives asked for (None: row does not ask).
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None
    logprob_rows: torch.Tensor | None = None  # int64 [num_rows_asking]

    @property
    def needs_logit_adjustment(self) -> bool:
        """Whether any row has a logit bias, a token ban, allowed token ids, penalties
        or a logits processor this step."""
        return (self.bias_rows is not None or self.banned_rows is not None
                or self.allowed_rows is not None or self.penalties is not None
                or self.processor_slots is not None)

    @property
    def may_allow_no_token(self) -> bool:
        """Whether a row's adjusted logits may be all ``-inf`` (nothing left to sample):
        some row has allowed token ids, token bans or a logits processor. Logit bias
        (within [-100, 100]) and penalties keep logits finite; a grammar bitmask alone
        that allows nothing is the structured-output manager's to diagnose (any token
        drawn breaks the grammar), one together with these masks is caught here."""
        return (self.allowed_rows is not None or self.banned_rows is not None
                or self.processor_slots is not None)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[int | None],
        vocab_size: int,
        device: torch.device,
        cache: SamplingCache | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> SamplingMetadata:
        """Gather the batch's sampling parameters into tensors on ``device``.

        Args:
            params: each row's request parameters.
            prompt_token_ids: each row's prompt (read only for repetition penalties).
            output_token_ids: each row's generated tokens so far (penalties, min_tokens,
                bad_words).
            generators: each row's own generator (from :func:`make_generator`) or
                ``None``; a random row with a generator draws only from it.
            eos_token_ids: each row's EOS id, banned while below ``min_tokens`` unless
                the request sets ``ignore_eos``.
            vocab_size: the logits' width.
            device: where the logits live.
            cache: the runner's per-request tensors (:class:`~lmkit.sample.row_cache.
                SamplingCache`: logit bias, allowed ids and penalty counts carried over
                between steps); without one they are built for this call alone.
            keys: each row's request id, for ``cache`` (a request's rows share it).

        Raises:
            InvalidRequestError: a logit_bias or allowed token id is outside
                ``[0, vocab_size)``.
        """
        num_rows = len(params)
        lengths = {len(prompt_token_ids), len(output_token_ids), len(generators),
                   len(eos_token_ids)}
        if lengths != {num_rows}:
            raise ValueError(
                f"SamplingMetadata.build needs one entry per row in every argument; got "
                f"{num_rows} params but lengths {sorted(lengths)} for the token lists, "
                "generators and eos ids")
        greedy = [p.is_greedy for p in params]
        md = cls(
            num_rows=num_rows, vocab_size=vocab_size,
            all_greedy=all(greedy), all_random=not any(greedy),
            is_greedy=upload(greedy, torch.bool, device),
            temperature=None, top_k=None, max_top_k=0, top_p=None, min_p=None,
        )
        if not md.all_greedy:
            md._set_random_sampling(params, greedy, generators, device)
        if cache is None or keys is None:
            cache, keys = SamplingCache(vocab_size, device), range(num_rows)
        md._set_logit_bias(params, cache, keys, device)
        md._set_banned_tokens(params, output_token_ids, eos_token_ids, device)
        md._set_allowed_tokens(params, cache, keys, device)
        md.penalties = build_penalty_tensors(params, prompt_token_ids, output_token_ids,
                                             vocab_size, device, cache, keys)
        md.num_logprobs = [p.logprobs for p in params]
        asking = [i for i, n in enumerate(md.num_logprobs) if n is not None]
        if asking:
            md.max_num_logprobs = max(md.num_logprobs[i] or 0 for i in asking)
            md.logprob_rows = upload(asking, torch.int64, device)
        return md

    def _set_random_sampling(self, params, greedy, generators, device) -> None:
        vocab_size = self.vocab_size
        temps, ks, ps, min_ps = [], [], [], []
        for p, g in zip(params, greedy, strict=True):
            temps.append(1.0 if g else p.temperature)
            ks.append(vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size))
            ps.append(1.0 if g else p.top_p)
            min_ps.append(0.0 if g else p.min_p)
        self.temperature = upload(temps, torch.float32, device)
        active_ks = [k for k in ks if k < vocab_size]
        if active_ks:
            self.top_k = upload(ks, torch.int64, device)
            self.max_top_k = max(active_ks)
        if any(p < 1.0 for p in ps):
            self.top_p = upload(ps, torch.float32, device)
        if any(m > 0.0 for m in min_ps):
            self.min_p = upload(min_ps, torch.float32, device)
        self.generators = {i: gen for i, (gen, g) in enumerate(zip(generators, greedy, strict=True))
                           if gen is not None and not g}

    def _set_logit_bias(self, params, cache, keys, device) -> None:
        rows = [i for i, p in enumerate(params) if p.logit_bias]
        if rows:
            pairs = [cache.bias(keys[i], params[i]) for i in rows]
            lengths = torch.tensor([len(t) for t, _ in pairs], dtype=torch.int64)
            self.bias_rows = upload(torch.repeat_interleave(
                torch.tensor(rows, dtype=torch.int64), lengths), torch.int64, device)
            self.bias_token_ids = torch.cat([t for t, _ in pairs])
            self.bias_values = torch.cat([v for _, v in pairs])

    def _set_banned_tokens(self, params, output_token_ids, eos_token_ids, device) -> None:
        rows: list[int] = []
        token_ids: list[int] = []
        for i, (p, eos) in enumerate(zip(params, eos_token_ids, strict=True)):
            for tok in sorted(banned_next_tokens(p, output_token_ids[i], eos)):
                if 0 <= tok < self.vocab_size:  # ids beyond the logits can't be sampled
                    rows.append(i)
                    token_ids.append(tok)
        if rows:
            self.banned_rows = upload(rows, torch.int64, device)
            self.banned_token_ids = upload(token_ids, torch.int64, device)

    def _set_allowed_tokens(self, params, cache, keys, device) -> None:
        rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
        if rows:
            slots = [cache.allowed_slot(keys[i], params[i]) for i in rows]
            self.allowed_rows = upload(rows, torch.int64, device)
            self.allowed_mask = cache.allowed_table().index_select(
                0, upload(slots, torch.int64, device))


def banned_next_tokens(params: SamplingParams, output: Sequence[int], eos: int | None
                       ) -> set[int]:
    """The tokens a request's own parameters forbid after ``output``: EOS (unless
    ``ignore_eos``) and ``stop_token_ids`` while below ``min_tokens``, and what
    :func:`bad_words_banned` bans."""
    banned: set[int] = set()
    if len(output) < params.min_tokens:
        banned.update(params.stop_token_ids)
        if eos is not None and not params.ignore_eos:
            banned.add(eos)
    if params.bad_words_token_ids:
        banned.update(bad_words_banned(params.bad_words_token_ids, output))
    return banned


def bad_words_banned(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens ``bad_words`` forbid next after ``output``: the last token of every
    bad word whose other tokens end ``output`` (a one-token word: always).

    O(total bad-word length); ``output`` is only indexed near its end.
    """
    n = len(output)
    banned = []
    for word in bad_words:
        m = len(word) - 1
        if m <= n and all(output[n - m + j] == word[j] for j in range(m)):
            banned.append(word[-1])
    return banned
