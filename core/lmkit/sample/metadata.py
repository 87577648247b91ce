"""Per-step sampling metadata: every request's sampling parameters as batch tensors.

Built once per step by the model runner (O(batch) Python work, plus O(tokens) for the
rows that use penalties), then consumed by :class:`lmkit.sample.sampler.Sampler`
without any per-row Python. Fields a step does not need are ``None`` so the sampler
skips that work entirely.

Speculative decoding verifies several positions per request: build the metadata with
one row per position (the request's params repeated, its output ids extended by the
drafts before that position), then :func:`lmkit.sample.sampler.adjust_logits` and
:func:`lmkit.sample.sampler.compute_probs` give the target distribution of every row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmkit.api.sampling_params import SamplingParams
from lmkit.errors import InvalidRequestError
from lmkit.sample.penalties import PenaltyTensors, build_penalty_tensors


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
    # min_tokens: (row, token id) pairs forbidden this step (EOS, stop_token_ids).
    banned_rows: torch.Tensor | None = None  # int64 [num_banned]
    banned_token_ids: torch.Tensor | None = None  # int64 [num_banned]
    penalties: PenaltyTensors | None = None
    # Logprobs: per-row count of alternatives asked for (None: row does not ask).
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None
    logprob_rows: torch.Tensor | None = None  # int64 [num_rows_asking]

    @property
    def needs_logit_adjustment(self) -> bool:
        """Whether any row has a logit bias, a min_tokens ban or penalties this step."""
        return (self.bias_rows is not None or self.banned_rows is not None
                or self.penalties is not None)

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
    ) -> SamplingMetadata:
        """Gather the batch's sampling parameters into tensors on ``device``.

        Args:
            params: each row's request parameters.
            prompt_token_ids: each row's prompt (read only for repetition penalties).
            output_token_ids: each row's generated tokens so far (penalties, min_tokens).
            generators: each row's own generator (from :func:`make_generator`) or
                ``None``; a random row with a generator draws only from it.
            eos_token_ids: each row's EOS id, banned while below ``min_tokens`` unless
                the request sets ``ignore_eos``.
            vocab_size: the logits' width.
            device: where the logits live.

        Raises:
            InvalidRequestError: a logit_bias token id is outside ``[0, vocab_size)``.
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
            is_greedy=torch.tensor(greedy, dtype=torch.bool).to(device),
            temperature=None, top_k=None, max_top_k=0, top_p=None, min_p=None,
        )
        if not md.all_greedy:
            md._set_random_sampling(params, greedy, generators, device)
        md._set_logit_bias(params, device)
        md._set_min_tokens_ban(params, output_token_ids, eos_token_ids, device)
        md.penalties = build_penalty_tensors(params, prompt_token_ids, output_token_ids,
                                             vocab_size, device)
        md.num_logprobs = [p.logprobs for p in params]
        asking = [i for i, n in enumerate(md.num_logprobs) if n is not None]
        if asking:
            md.max_num_logprobs = max(md.num_logprobs[i] for i in asking)
            md.logprob_rows = torch.tensor(asking, dtype=torch.int64).to(device)
        return md

    def _set_random_sampling(self, params, greedy, generators, device) -> None:
        vocab_size = self.vocab_size
        temps, ks, ps, min_ps = [], [], [], []
        for p, g in zip(params, greedy, strict=True):
            temps.append(1.0 if g else p.temperature)
            ks.append(vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size))
            ps.append(1.0 if g else p.top_p)
            min_ps.append(0.0 if g else p.min_p)
        self.temperature = torch.tensor(temps, dtype=torch.float32).to(device)
        active_ks = [k for k in ks if k < vocab_size]
        if active_ks:
            self.top_k = torch.tensor(ks, dtype=torch.int64).to(device)
            self.max_top_k = max(active_ks)
        if any(p < 1.0 for p in ps):
            self.top_p = torch.tensor(ps, dtype=torch.float32).to(device)
        if any(m > 0.0 for m in min_ps):
            self.min_p = torch.tensor(min_ps, dtype=torch.float32).to(device)
        self.generators = {i: gen for i, (gen, g) in enumerate(zip(generators, greedy, strict=True))
                           if gen is not None and not g}

    def _set_logit_bias(self, params, device) -> None:
        rows: list[int] = []
        token_ids: list[int] = []
        values: list[float] = []
        for i, p in enumerate(params):
            if not p.logit_bias:
                continue
            for tok, bias in p.logit_bias.items():
                if not 0 <= tok < self.vocab_size:
                    raise InvalidRequestError(
                        f"logit_bias names token id {tok}, but the model's vocabulary has "
                        f"ids 0..{self.vocab_size - 1}; remove it or use a valid id",
                        param="logit_bias", code="invalid_value")
                rows.append(i)
                token_ids.append(tok)
                values.append(bias)
        if rows:
            self.bias_rows = torch.tensor(rows, dtype=torch.int64).to(device)
            self.bias_token_ids = torch.tensor(token_ids, dtype=torch.int64).to(device)
            self.bias_values = torch.tensor(values, dtype=torch.float32).to(device)

    def _set_min_tokens_ban(self, params, output_token_ids, eos_token_ids, device) -> None:
        rows: list[int] = []
        token_ids: list[int] = []
        for i, (p, eos) in enumerate(zip(params, eos_token_ids, strict=True)):
            if len(output_token_ids[i]) >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids)
            if eos is not None and not p.ignore_eos:
                banned.add(eos)
            for tok in sorted(banned):
                if 0 <= tok < self.vocab_size:  # ids beyond the logits can't be sampled
                    rows.append(i)
                    token_ids.append(tok)
        if rows:
            self.banned_rows = torch.tensor(rows, dtype=torch.int64).to(device)
            self.banned_token_ids = torch.tensor(token_ids, dtype=torch.int64).to(device)
