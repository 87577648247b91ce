"""Log-probabilities in OpenAI's two shapes.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (parallel
lists; ``top_logprobs`` maps token text to log-probability and includes the sampled
token). Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
Token text is each token decoded alone, cached per id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lmkit.api.outputs import TokenLogprob

_FLOOR = -9999.0  # JSON has no -inf; OpenAI clients expect a number


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _FLOOR


class TokenTexts:
    """Each token id's text, decoded alone and cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def completion_logprobs(texts: TokenTexts, logprobs: Sequence[TokenLogprob | None],
                        token_ids: Sequence[int], num_top: int, text_offset: int = 0
                        ) -> dict[str, Any]:
    """The completions-API ``logprobs`` object for ``token_ids``.

    ``logprobs[i]`` belongs to ``token_ids[i]``; ``None`` (the first prompt token when
    echoing) gives a ``null`` log-probability. ``text_offset`` is where the first token
    starts in the returned text.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for tid, lp in zip(token_ids, logprobs, strict=False):
        text = texts(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(lp.logprob))
        top = {texts(t): _finite(v) for t, v in lp.top[:num_top]}
        top.setdefault(text, _finite(lp.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs, "text_offset": offsets}


def merge_completion_logprobs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two completions ``logprobs`` objects, one after the other (echoed prompt + output)."""
    return {k: [*a[k], *b[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                         "text_offset")}


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(texts: TokenTexts, logprobs: Sequence[TokenLogprob], num_top: int
                  ) -> dict[str, Any]:
    """The chat-API ``logprobs`` object: one entry per generated token."""
    content = []
    for lp in logprobs:
        entry = _entry(texts(lp.token_id), lp.logprob)
        entry["top_logprobs"] = [_entry(texts(t), v) for t, v in lp.top[:num_top]]
        content.append(entry)
    return {"content": content, "refusal": None}
