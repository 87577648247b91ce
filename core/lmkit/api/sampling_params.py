"""Per-request sampling parameters, validated once when the request is made."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lmkit.errors import InvalidRequestError

MAX_LOGPROBS = 20
# integers cross to the engine process as msgpack int64 and into int64 tensors
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# What one request's per-token work may cost the others. Stop strings are matched in
# the API process on every output token (one automaton: the bound is on building it);
# the token lists below are turned into tensors for every engine step of every row the
# request owns, and bad words are checked at every step (about 0.3 us per entry per
# row and step on a CPU host: 131,072 logit_bias entries cost 40 ms per row and step).
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 8192  # all of a request's stop strings together
MAX_TOKEN_IDS = 2048  # entries of allowed_token_ids, stop_token_ids and logit_bias each
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_CHARS = 8192  # all of a request's bad words together


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
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {msg}", param=param, code="invalid_value")

        self._check_types(bad)
        for name in ("seed", "top_k", "max_tokens", "min_tokens"):
            v = getattr(self, name)
            if isinstance(v, int) and not INT64_MIN <= v <= INT64_MAX:
                raise bad(name, f"must be a 64-bit integer, in [{INT64_MIN}, {INT64_MAX}]; "
                          f"got {v}")
        if self.n < 1 or self.n > 128:
            raise bad("n", f"must be an integer in [1, 128], got {self.n!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {v}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise bad(name, f"must be in [0, {MAX_LOGPROBS}], got {v}")
        self._validate_stops(bad)
        self.logit_bias = _logit_bias(self.logit_bias, bad)
        self._validate_token_constraints(bad)

    def _check_types(self, bad: Any) -> None:
        """Refuse values of the wrong type (``"0.5"``, ``1.5`` tokens, ``True`` as a count,
        ``"no"`` as a flag) before they reach the sampler; normalize numpy scalars."""
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if v is None and name in _OPTIONAL:
                continue
            if not _is_int(v):
                raise bad(name, f"must be an integer{' or None' if name in _OPTIONAL else ''}, "
                          f"got {_shown(v)}")
            setattr(self, name, int(v))
        for name in _FLOAT_FIELDS:
            v = _real(getattr(self, name))
            if v is None:
                raise bad(name, f"must be a number, got {_shown(getattr(self, name))}")
            setattr(self, name, v)
        for name in _BOOL_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise bad(name, f"must be true or false, got {_shown(v)}")

    def _validate_stops(self, bad: Any) -> None:
        """``stop``: a string or a list of non-empty strings; ``stop_token_ids``: ints."""
        stop = _as_list(self.stop, "stop", "a string or a list of strings", bad, one=str)
        _check_count(stop, MAX_STOP_STRINGS, "stop", "stop strings", bad)
        if any(not isinstance(s, str) for s in stop):
            raise bad("stop", f"must be a list of strings, got {_shown(stop)}")
        if any(not s for s in stop):
            raise bad("stop", "must not contain empty strings")
        _check_chars(stop, MAX_STOP_CHARS, "stop", "stop strings", bad)
        self.stop = stop
        ids = _as_list(self.stop_token_ids, "stop_token_ids", "a list of token ids", bad)
        _check_count(ids, MAX_TOKEN_IDS, "stop_token_ids", "token ids", bad)
        if any(not _is_int(t) for t in ids):
            raise bad("stop_token_ids", f"must be a list of integer token ids, got {ids!r}")
        self.stop_token_ids = [int(t) for t in ids]

    def _validate_token_constraints(self, bad: Any) -> None:
        """allowed_token_ids, bad_words, logits_processors, extra_args (vocabulary bounds
        are checked by the frontend, which knows the model)."""
        if self.allowed_token_ids is not None:
            ids = _as_list(self.allowed_token_ids, "allowed_token_ids",
                           "a list of token ids", bad)
            _check_count(ids, MAX_TOKEN_IDS, "allowed_token_ids", "token ids", bad)
            if not ids:
                raise bad("allowed_token_ids", "must not be empty (leave it unset to allow "
                          "every token)")
            if any(not _is_int(t) or t < 0 for t in ids):
                raise bad("allowed_token_ids", f"must be non-negative token ids, got {ids[:5]}")
            self.allowed_token_ids = [int(t) for t in ids]
        if self.bad_words is not None:
            words = _as_list(self.bad_words, "bad_words", "a list of strings", bad, one=str)
            _check_count(words, MAX_BAD_WORDS, "bad_words", "words", bad)
            if any(not isinstance(w, str) or not w.strip() for w in words):
                raise bad("bad_words", f"must be non-empty strings, got {_shown(words)}")
            _check_chars(words, MAX_BAD_WORDS_CHARS, "bad_words", "bad words", bad)
            self.bad_words = words
        if self.bad_words_token_ids is not None:
            outer = _as_list(self.bad_words_token_ids, "bad_words_token_ids",
                             "a list of lists of token ids", bad)
            if any(not isinstance(w, (list, tuple)) or not w
                   or any(not _is_int(t) or t < 0 for t in w) for w in outer):
                raise bad("bad_words_token_ids", "must be non-empty lists of non-negative "
                          f"token ids, got {self.bad_words_token_ids!r}")
            self.bad_words_token_ids = [[int(t) for t in w] for w in outer]
        if self.logits_processors is not None:
            names = _as_list(self.logits_processors, "logits_processors",
                             "a list of names", bad, one=str)
            if any(not isinstance(n, str) or not n for n in names):
                raise bad("logits_processors", "must be names of registered logits "
                          f"processors, got {self.logits_processors!r}")
            self.logits_processors = list(dict.fromkeys(names))
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", f"must be a mapping, got {type(self.extra_args).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


_INT_FIELDS = ("n", "top_k", "min_tokens", "seed", "max_tokens", "logprobs", "prompt_logprobs")
_OPTIONAL = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                "use_spec_decode")


def _is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: Any) -> float | None:
    """``value`` as a float (an int too large for one is infinite, so out of any range);
    ``None`` if it is not a real number (a string, ``None``, a bool)."""
    if not _is_real(value):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:60] + "..."
    return f"{text} ({type(value).__name__})"


def _as_list(value: Any, param: str, expected: str, bad: Any, one: type | None = None
             ) -> list[Any]:
    """``value`` as a list: ``None`` is empty, a single ``one`` (``str``) is a list of one;
    anything but a list or tuple is refused (a string is not a list of token ids)."""
    if value is None:
        return []
    if one is not None and isinstance(value, one):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise bad(param, f"must be {expected}, got {_shown(value)}")
    return list(value)


def _check_count(items: Any, limit: int, param: str, what: str, bad: Any) -> None:
    """Refuse more than ``limit`` items (checked before the items are looked at)."""
    if len(items) > limit:
        raise bad(param, f"has {len(items)} {what}; at most {limit} are allowed per "
                  f"request (each costs work on every generated token, shared with the "
                  f"other requests); send fewer")


def _check_chars(texts: list[str], limit: int, param: str, what: str, bad: Any) -> None:
    """Refuse texts longer than ``limit`` characters in all."""
    total = sum(len(t) for t in texts)
    if total > limit:
        raise bad(param, f"holds {total} characters in all; at most {limit} are allowed per "
                  f"request (each generated token is checked against them); send fewer or "
                  f"shorter {what}")


def _logit_bias(bias: Any, bad: Any) -> dict[int, float] | None:
    """``{token id: bias}`` with ids as ints (or strings of ints, as OpenAI's JSON has them)
    and biases finite numbers in [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise bad("logit_bias", f"must be a mapping of token id to bias, got {_shown(bias)}")
    _check_count(bias, MAX_TOKEN_IDS, "logit_bias", "entries", bad)
    out: dict[int, float] = {}
    for tok, b in bias.items():
        key = _token_key(tok)
        if key is None:
            raise bad("logit_bias", f"keys must be integer token ids, got {_shown(tok)}")
        value = _real(b)
        if value is None or not -100.0 <= value <= 100.0:
            raise bad("logit_bias", f"values must be numbers in [-100, 100], got {b!r} for "
                      f"token {tok!r}")
        out[key] = value
    return out


def _token_key(tok: Any) -> int | None:
    """A logit_bias key as a token id: an int, or a string of one (``"50256"``)."""
    if _is_int(tok):
        return int(tok)
    if isinstance(tok, str):
        try:
            return int(tok)
        except ValueError:
            return None
    return None
