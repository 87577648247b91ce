"""Turning user input (text, token ids, chat messages) into validated requests."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from lmkit.api.pooling import PoolingParams
from lmkit.api.request import Request
from lmkit.api.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from lmkit.errors import NO_ALLOWED_TOKEN, InvalidRequestError
from lmkit.structured.constraint import validate_structured_outputs
from lmkit.structured.fault import shown_ids


class InputProcessor:
    """Tokenizes and validates prompts against the model's context and vocabulary.

    ``max_model_len``, ``vocab_size`` and ``eos_token_ids`` are the engine's
    :class:`~lmkit.api.ModelFacts`. Each request carries the first EOS id; the others
    stop generation like EOS does and are added to its ``stop_token_ids``.
    ``max_constraint_chars`` bounds a structured-output constraint's size
    (``structured_output.max_constraint_chars``; ``None``: no bound).
    ``logits_processors`` are the names of the logits processors the engine has; a
    request naming another is refused.
    """

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 eos_token_ids: Sequence[int] = (), max_constraint_chars: int | None = None,
                 logits_processors: Collection[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id: int | None = eos_token_ids[0] if eos_token_ids else None
        self.extra_eos_token_ids = [t for t in eos_token_ids[1:] if t != self.eos_token_id]
        self.max_constraint_chars = max_constraint_chars
        self._last_constraint: Any = None  # the last constraint object validated
        # the last bad_words tokenized, and their token ids
        self._last_bad_words: tuple[tuple[str, ...], list[list[int]]] = ((), [])
        self.logits_processors = frozenset(logits_processors)

    def tokenize(self, prompt: str | Sequence[int] | None,
                 messages: list[dict[str, Any]] | None = None,
                 chat_kwargs: dict[str, Any] | None = None) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for a text prompt, token ids, or chat messages."""
        if messages is not None:
            from lmkit.text.chat import render_chat

            text = render_chat(self.tokenizer, messages, **(chat_kwargs or {}))
            return text, list(self.tokenizer.encode(text, add_special_tokens=False))
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt",
                                          code="invalid_value")
            return prompt, list(self.tokenizer.encode(prompt))
        if prompt is None:
            raise InvalidRequestError("a prompt or messages is required", param="prompt",
                                      code="missing")
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt",
                                      code="invalid_value")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}",
                param="prompt", code="invalid_value")
        return None, ids

    def tokenize_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts in one tokenizer call (a fast tokenizer encodes them
        in parallel); the same ids as :meth:`tokenize` gives each."""
        if any(not t for t in texts):
            raise InvalidRequestError("prompt must not be empty", param="prompt",
                                      code="invalid_value")
        return [list(ids) for ids in self.tokenizer(list(texts))["input_ids"]]

    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, priority: int = 0,
                     cache_salt: str | None = None) -> Request:
        """A validated :class:`Request`; raises InvalidRequestError with an OpenAI-style code."""
        n_prompt = len(prompt_token_ids)
        if n_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n_prompt} tokens, but this model's context is "
                f"{self.max_model_len} tokens (at least one must be left to generate); "
                "shorten the prompt", param="prompt", code="context_length_exceeded")
        room = self.max_model_len - n_prompt
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise InvalidRequestError(
                f"this model's context is {self.max_model_len} tokens; the prompt has "
                f"{n_prompt} and max_tokens asks for {max_tokens} more ({n_prompt + max_tokens} "
                f"in all); lower max_tokens to at most {room}",
                param="max_tokens", code="context_length_exceeded")
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) is more than can be generated: this "
                f"model's context is {self.max_model_len} tokens and the prompt has {n_prompt}, "
                f"which leaves {room}; lower min_tokens to at most {max_tokens}",
                param="min_tokens", code="invalid_value")
        if not INT64_MIN <= priority <= INT64_MAX:
            raise InvalidRequestError(f"priority must be a 64-bit integer, in [{INT64_MIN}, "
                                      f"{INT64_MAX}]; got {priority}", param="priority",
                                      code="invalid_value")
        for t in [*params.stop_token_ids, *(params.logit_bias or {})]:
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(f"token id {t} is outside the vocabulary "
                                          f"[0, {self.vocab_size})", param="stop_token_ids"
                                          if t in params.stop_token_ids else "logit_bias",
                                          code="invalid_value")
        self._validate_constraint(params.structured_outputs)
        params = self._token_constraints(params)
        if self.extra_eos_token_ids and not params.ignore_eos:
            extra = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
            if extra:
                params = _with(params, stop_token_ids=[*params.stop_token_ids, *extra])
        self._check_some_token_allowed(params)
        return Request(request_id, prompt_token_ids, params, eos_token_id=self.eos_token_id,
                       priority=priority, cache_salt=cache_salt, max_tokens=max_tokens)

    def make_pooling_request(self, request_id: str, prompt_token_ids: list[int],
                             params: PoolingParams, priority: int = 0) -> Request:
        """A validated pooling request (prefill only: the whole prompt may fill the
        context); raises InvalidRequestError with an OpenAI-style code."""
        n_prompt = len(prompt_token_ids)
        if n_prompt > self.max_model_len:
            raise InvalidRequestError(
                f"the input has {n_prompt} tokens, but this model's context is "
                f"{self.max_model_len} tokens; shorten the input", param="input",
                code="context_length_exceeded")
        if not INT64_MIN <= priority <= INT64_MAX:
            raise InvalidRequestError(f"priority must be a 64-bit integer, in [{INT64_MIN}, "
                                      f"{INT64_MAX}]; got {priority}", param="priority",
                                      code="invalid_value")
        return Request(request_id, prompt_token_ids, POOLING_SAMPLING, priority=priority,
                       max_tokens=1, pooling_params=params)

    def _validate_constraint(self, structured_outputs: Any) -> None:
        """Refuse a malformed, too long or endless constraint (the engine compiles it).
        The ``n`` completions and the prompts of one request share one constraint
        object: it is checked once, not once per sequence (a large schema takes ms)."""
        if structured_outputs is None or structured_outputs is self._last_constraint:
            return
        validate_structured_outputs(structured_outputs, self.max_constraint_chars)
        self._last_constraint = structured_outputs

    def _token_constraints(self, params: SamplingParams) -> SamplingParams:
        """Check allowed_token_ids and logits_processors; tokenize bad_words."""
        self.check_ids("allowed_token_ids", params.allowed_token_ids or [])
        for words in params.bad_words_token_ids or []:
            self.check_ids("bad_words_token_ids", words)
        unknown = [n for n in params.logits_processors or [] if n not in self.logits_processors]
        if unknown:
            from lmkit.plugin_host.registry import suggest

            known = ", ".join(sorted(self.logits_processors)) or "none (no plugin registers one)"
            raise InvalidRequestError(
                f"unknown logits processor {unknown[0]!r}; known: {known}."
                f"{suggest(unknown[0], self.logits_processors)} Install or load (-p NAME) "
                "the plugin that registers it, or remove it from logits_processors.",
                param="logits_processors", code="invalid_value")
        if params.bad_words:
            word_ids = [*(params.bad_words_token_ids or []),
                        *self._bad_words_token_ids(params.bad_words)]
            params = _with(params, bad_words_token_ids=word_ids)
        return params

    def _bad_words_token_ids(self, bad_words: Sequence[str]) -> list[list[int]]:
        """:func:`tokenize_bad_words` of ``bad_words``, reused while they repeat (the
        ``n`` completions of a request carry equal lists: tokenized once, not n times)."""
        key = tuple(bad_words)
        last_key, last_ids = self._last_bad_words
        if key != last_key:
            last_ids = tokenize_bad_words(self.tokenizer, key)
            self._last_bad_words = (key, last_ids)
        return [list(ids) for ids in last_ids]

    def _check_some_token_allowed(self, params: SamplingParams) -> None:
        """Refuse a request whose own token rules leave nothing to sample at its first
        output token: each of its ``allowed_token_ids`` ends the output (EOS unless
        ``ignore_eos``, or a stop token id) while ``min_tokens`` forbids that, or is a
        one-token bad word. (Rules that leave nothing only later, e.g. a longer bad
        word, end the request when it gets there: ``no_allowed_token``.)"""
        allowed = sorted(set(params.allowed_token_ids or ()))
        if not allowed:
            return
        eos = None if params.ignore_eos else self.eos_token_id
        ending = set(params.stop_token_ids) if params.min_tokens > 0 else set()
        if params.min_tokens > 0 and eos is not None:
            ending.add(eos)
        bad = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
        if any(t not in ending and t not in bad for t in allowed):
            return
        ids, m = shown_ids(allowed), params.min_tokens
        enders = "stop_token_ids" if eos is None else f"EOS {eos} or stop_token_ids"
        ends = f"ends the output ({enders}), which min_tokens = {m} forbids before {m} tokens"
        if not bad.intersection(allowed):
            message = (f"every one of allowed_token_ids {ids} {ends}: nothing is left to "
                       "sample at the first output token; allow other tokens or lower "
                       "min_tokens to 0")
        elif ending.intersection(allowed):
            message = (f"every one of allowed_token_ids {ids} either {ends}, or is a "
                       "one-token bad word: nothing is left to sample at the first output "
                       "token; allow other tokens, lower min_tokens to 0 or remove the "
                       "bad word")
        else:
            raise InvalidRequestError(
                f"bad_words forbid every one of allowed_token_ids {ids} (each is a "
                "one-token bad word): nothing is left to sample; remove the bad word or "
                "allow other tokens", param="bad_words", code=NO_ALLOWED_TOKEN)
        raise InvalidRequestError(message, param="min_tokens", code=NO_ALLOWED_TOKEN)

    def check_ids(self, param: str, ids: Sequence[int]) -> None:
        """Refuse token ids outside the vocabulary, naming ``param`` (400)."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{param} has token ids outside the vocabulary [0, {self.vocab_size}): "
                f"{bad[:5]}; use ids the model knows", param=param, code="invalid_value")


def tokenize_bad_words(tokenizer: Any, bad_words: Sequence[str]) -> list[list[int]]:
    """Each bad word's token ids, as it stands and with a leading space (the form it
    takes after another word), without special tokens; duplicates dropped.

    A word that starts a text and the same word after a space usually tokenize
    differently (``"world"`` vs ``" world"``), and either may be generated.
    """
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()  # (a list membership test made this quadratic)
    for word in bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and tuple(ids) not in seen:
                seen.add(tuple(ids))
                out.append(ids)
    return out


# what a pooling request carries as sampling parameters: it never samples
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


def _with(params: SamplingParams, **changes: Any) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **changes)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sampling parameters of the ``index``-th of ``n`` completions: n=1, and a distinct
    but reproducible seed when the parent has one (wrapping around within 64 bits, so that
    a seed near the top of the range stays valid for every child)."""
    seed = None if params.seed is None else (params.seed + index - INT64_MIN) % 2**64 + INT64_MIN
    return _with(params, n=1, seed=seed)
