"""Log-probabilities in OpenAI's two shapes.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (parallel
lists; ``top_logprobs`` maps token text to log-probability and includes the sampled
token). Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
Token text is each token decoded alone, cached per id. A token holding part of a
multi-byte character decodes alone to U+FFFD; its chat ``bytes`` are then its raw bytes
(byte-level BPE or ``<0xNN>`` byte-fallback pieces), so that concatenated they rebuild the
text, as OpenAI documents.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from lmkit.api.outputs import TokenLogprob

_FLOOR = -9999.0  # JSON has no -inf; OpenAI clients expect a number
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a piece."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(extra)}}


_BYTE_LEVEL = _byte_level_decoder()


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _FLOOR


class TokenTexts:
    """Each token id's text, decoded alone and cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes: its raw bytes when its text alone is not whole."""
        raw = self._bytes.get(token_id)
        if raw is None:
            text = self(token_id)
            raw = list(text.encode("utf-8"))
            if "\ufffd" in text:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                m = _BYTE_PIECE.fullmatch(piece) if isinstance(piece, str) else None
                if m:
                    raw = [int(m.group(1), 16)]
                elif isinstance(piece, str) and piece and all(c in _BYTE_LEVEL for c in piece):
                    raw = [_BYTE_LEVEL[c] for c in piece]
            self._bytes[token_id] = raw
        return raw


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
        top = {texts(t): _finite(v) for t, v in lp.iter_top(num_top)}
        top.setdefault(text, _finite(lp.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs, "text_offset": offsets}


def merge_completion_logprobs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two completions ``logprobs`` objects, one after the other (echoed prompt + output)."""
    return {k: [*a[k], *b[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                         "text_offset")}


def logprobs_cost(logprobs: Sequence[TokenLogprob | None] | None, num_top: int) -> int:
    """About how much work the JSON of ``logprobs`` is: one per token and alternative."""
    return len(logprobs or ()) * (1 + num_top)


def text_cost(text: str) -> int:
    """About how much work ``text`` in a JSON body is, on the scale of
    :func:`logprobs_cost`: one per 64 characters."""
    return len(text) // 64


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": texts(token_id), "logprob": _finite(logprob),
            "bytes": texts.token_bytes(token_id)}


def chat_logprobs(texts: TokenTexts, logprobs: Sequence[TokenLogprob], num_top: int,
                  lazy: bool = False) -> dict[str, Any]:
    """The chat-API ``logprobs`` object: one entry per generated token. ``lazy``: its
    ``content`` is an iterator building the entries as they are consumed (for
    :func:`~lmkit.serve.streaming.encode_in_pieces`)."""
    content = (_chat_entry(texts, lp, num_top) for lp in logprobs)
    return {"content": content if lazy else list(content), "refusal": None}


def _chat_entry(texts: TokenTexts, lp: TokenLogprob, num_top: int) -> dict[str, Any]:
    entry = _entry(texts, lp.token_id, lp.logprob)
    entry["top_logprobs"] = [_entry(texts, t, v) for t, v in lp.iter_top(num_top)]
    return entry
