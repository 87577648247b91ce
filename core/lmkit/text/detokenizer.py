"""Incremental detokenization: token ids in, newly readable text out.

Uses the prefix-offset / read-offset technique of TGI and vLLM. Each step decodes only a
small window of recent ids twice: ``ids[prefix_offset:read_offset]`` (text already
emitted, kept as context) and ``ids[prefix_offset:]`` (the same plus the new ids). The
new text is the difference. Decoding with context keeps tokenizer-specific spacing
right (e.g. sentencepiece's leading-space handling) without re-decoding the whole
output, so each push costs O(window), O(1) amortised per token.

Multi-byte characters split across tokens (byte-level BPE pieces, or sentencepiece
byte-fallback tokens such as ``<0xE6>``) decode to U+FFFD until their last byte
arrives. Text ending in U+FFFD is therefore held back, and released once the character
completes; text before it is emitted at once.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"
# Prompt ids kept as decoding context for the first output tokens (as vLLM does).
_NUM_CONTEXT_IDS = 5


class IncrementalDetokenizer:
    """Turns one request's output token ids into text as they arrive.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with ``decode(ids,
            skip_special_tokens=..., clean_up_tokenization_spaces=...)``).
        prompt_token_ids: the request's prompt; its last few ids are decoding context
            only and never appear in :attr:`text`.
        skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.

    Attributes:
        text: all output text emitted so far (the concatenation of ``push`` results).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        # Only the window [prefix_offset:] is ever decoded; older ids are dropped.
        self._ids: list[int] = list(prompt_token_ids[-_NUM_CONTEXT_IDS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        # Characters of the current window's new text already emitted (text before a
        # held-back incomplete character).
        self._num_emitted = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        # No clean-up: it rewrites spaces by looking at neighbours, which would make
        # the window's text depend on where the window starts.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def push(self, token_ids: list[int]) -> str:
        """Add newly generated ids; return the text they complete (may be ``""``)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        window_text = self._decode(self._ids[self._prefix_offset:])
        if len(window_text) <= len(self._prefix_text):
            return ""  # e.g. only skipped special tokens so far
        new_text = window_text[len(self._prefix_text):]
        if new_text.endswith(_REPLACEMENT):
            # Possibly an incomplete character: emit only what precedes the trailing
            # replacement characters, and keep the window open.
            stable = new_text.rstrip(_REPLACEMENT)
            delta = stable[self._num_emitted:]
            self._num_emitted = max(self._num_emitted, len(stable))
        else:
            delta = new_text[self._num_emitted:]
            self._advance(window_text)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Release text held back at the end of the output (replacement characters
        of a byte sequence that never completed). Call once, when the request ends;
        returns ``""`` when nothing is held back."""
        window_text = self._decode(self._ids[self._prefix_offset:])
        delta = window_text[len(self._prefix_text) + self._num_emitted:]
        if delta:
            self._advance(window_text)
            self.text += delta
        return delta

    def _advance(self, window_text: str) -> None:
        """Everything decoded so far is emitted: the read part becomes the context."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        self._num_emitted = 0
        # Drop ids before the window so memory stays bounded.
        if self._prefix_offset > 0:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
