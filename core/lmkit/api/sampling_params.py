"""Per-request sampling parameters, validated once when the request is made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmkit.errors import InvalidRequestError

MAX_LOGPROBS = 20
# integers cross to the engine process as msgpack int64 and into int64 tensors
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    """How to sample one request's output.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` turn those filters
    off. Penalties follow OpenAI (frequency, presence: output tokens only) and the
    CTRL paper (repetition: prompt and output). ``seed`` makes a request's samples
    reproducible whatever else is in the batch. ``logprobs`` returns the sampled token's
    log-probability plus that many alternatives per token; ``prompt_logprobs`` the same
    for prompt positions.

    ``allowed_token_ids`` restricts every sampled token to those ids. ``bad_words`` are
    strings that must not be generated: the frontend tokenizes each (as is and with a
    leading space) into ``bad_words_token_ids``, and the sampler bans a word's last
    token whenever the output ends with its other tokens (a one-token word is banned
    always). ``logits_processors`` names plugin logits processors to apply to this
    request; ``extra_args`` carries their arguments.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    use_spec_decode: bool = True
    # A constraint for structured output, e.g. {"json": {...}} / {"regex": "..."};
    # interpreted by the structured-output backend.
    structured_outputs: dict[str, Any] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # bad_words as token ids (set by the frontend's tokenizer; may also be given directly)
    bad_words_token_ids: list[list[int]] | None = None
    logits_processors: list[str] | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {msg}", param=param, code="invalid_value")

        for name in ("seed", "top_k", "max_tokens", "min_tokens"):
            v = getattr(self, name)
            if isinstance(v, int) and not INT64_MIN <= v <= INT64_MAX:
                raise bad(name, f"must be a 64-bit integer, in [{INT64_MIN}, {INT64_MAX}]; "
                          f"got {v}")
        if not isinstance(self.n, int) or self.n < 1 or self.n > 128:
            raise bad("n", f"must be an integer in [1, 128], got {self.n!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {v}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise bad(name, f"must be in [0, {MAX_LOGPROBS}], got {v}")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if self.logit_bias:
            for tok, b in self.logit_bias.items():
                if not -100.0 <= float(b) <= 100.0:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {b} for token {tok}")
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate_token_constraints(bad)

    def _validate_token_constraints(self, bad: Any) -> None:
        """allowed_token_ids, bad_words, logits_processors, extra_args (vocabulary bounds
        are checked by the frontend, which knows the model)."""
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            if not ids:
                raise bad("allowed_token_ids", "must not be empty (leave it unset to allow "
                          "every token)")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise bad("allowed_token_ids", f"must be non-negative token ids, got {ids[:5]}")
            self.allowed_token_ids = ids
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise bad("bad_words", f"must be non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
        if self.bad_words_token_ids is not None:
            words = [list(w) for w in self.bad_words_token_ids]
            if any(not w or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                for t in w) for w in words):
                raise bad("bad_words_token_ids", "must be non-empty lists of non-negative "
                          f"token ids, got {self.bad_words_token_ids!r}")
            self.bad_words_token_ids = words
        if self.logits_processors is not None:
            if isinstance(self.logits_processors, str):
                self.logits_processors = [self.logits_processors]
            if any(not isinstance(n, str) or not n for n in self.logits_processors):
                raise bad("logits_processors", "must be names of registered logits "
                          f"processors, got {self.logits_processors!r}")
            self.logits_processors = list(dict.fromkeys(self.logits_processors))
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", f"must be a mapping, got {type(self.extra_args).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)
