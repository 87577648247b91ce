"""Incremental detokenization in the tokenizer's own Rust code (``tokenizers.DecodeStream``).

:class:`StreamDetokenizer` is the fast path of :class:`~lmkit.text.detokenizer.
IncrementalDetokenizer` for Hugging Face *fast* tokenizers (the ones backed by the Rust
``tokenizers`` library, i.e. nearly all of them): ``DecodeStream.step`` runs the same
prefix-offset / read-offset technique in Rust, about 1 us per token instead of the 5-6 us
of two or three ``tokenizer.decode`` calls through transformers. :func:`make_detokenizer`
picks it whenever the tokenizer allows, and the Python detokenizer otherwise (slow
sentencepiece tokenizers, or a tokenizer class that overrides ``decode``).

The text is the same: the pieces concatenate to ``tokenizer.decode(output_ids,
skip_special_tokens=..., clean_up_tokenization_spaces=False)``. One difference in timing:
a token whose text ends in an incomplete multi-byte character is released whole once the
character completes (the Python detokenizer releases the complete part at once).
"""

from __future__ import annotations

from typing import Any

from lmkit.text.detokenizer import _NUM_CONTEXT_IDS, _REPLACEMENT, IncrementalDetokenizer


def backend_tokenizer(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` that decodes for ``tokenizer``, or None when
    ``tokenizer.decode`` is not simply that tokenizer's decode (a slow tokenizer, or a
    class that overrides ``decode`` / ``_decode``)."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerFast.decode or \
            cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    return tokenizer.backend_tokenizer


class StreamDetokenizer:
    """One request's output ids to text with ``tokenizers.DecodeStream``; the same
    interface as :class:`~lmkit.text.detokenizer.IncrementalDetokenizer` (``push``,
    ``flush``, ``text``).

    Args:
        backend: the Rust tokenizer (:func:`backend_tokenizer`).
        prompt_token_ids: the prompt; its last few ids are decoding context only.
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, backend: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._skip = skip_special_tokens
        self.text = ""
        context = list(prompt_token_ids[-_NUM_CONTEXT_IDS:])
        # context ending inside a multi-byte character would make the stream's prefix
        # end in U+FFFD, which the completed character does not start with
        while context and self._decode(context).endswith(_REPLACEMENT):
            context.pop()
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._step = self._stream.step
        # ids pushed since the last emitted text, and the ids that text came from (the
        # context flush() decodes a held-back incomplete character with)
        self._pending: list[int] = []
        self._last: list[int] = context

    def _decode(self, ids: list[int]) -> str:
        return str(self._backend.decode(ids, skip_special_tokens=self._skip))

    def push(self, token_ids: list[int]) -> str:
        """Add newly generated ids; return the text they complete (may be ``""``)."""
        if len(token_ids) == 1:
            piece = self._step(self._backend, token_ids[0])
        elif token_ids:
            piece = self._step(self._backend, token_ids)
        else:
            return ""
        if piece is None:
            self._pending.extend(token_ids)
            return ""
        self._last = self._pending + token_ids if self._pending else token_ids
        self._pending = []
        self.text += piece
        return str(piece)

    def flush(self) -> str:
        """Release what is held back at the end of the output (an incomplete character:
        U+FFFD, as a full decode shows it). Call once, when the request ends."""
        if not self._pending:
            return ""
        prefix = self._decode(self._last)
        delta = self._decode(self._last + self._pending)[len(prefix):]
        self._pending = []
        self.text += delta
        return delta


def make_detokenizer(tokenizer: Any, prompt_token_ids: list[int],
                     skip_special_tokens: bool = True
                     ) -> StreamDetokenizer | IncrementalDetokenizer:
    """The fastest detokenizer ``tokenizer`` allows for one request."""
    backend = backend_tokenizer(tokenizer)
    if backend is None:
        return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return StreamDetokenizer(backend, prompt_token_ids, skip_special_tokens)
