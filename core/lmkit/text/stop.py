"""Stop strings over streamed text.

Text arrives in chunks (one per detokenizer push). A stop string may span chunks, so
any suffix of the text seen so far that is the beginning of a stop string is held back
until the next chunk shows whether it completes one. Nothing that could become part of
a stop string is ever emitted, so streamed deltas never contain a stop string (unless
``include_stop_str_in_output``).

``min_tokens`` (as vLLM does it): the text of a request's first ``min_tokens`` output
tokens is fed with ``can_match=False``, so no stop string is matched inside it, neither
then nor later (a match must always end in text fed after it). A stop string that
starts inside that text and is completed by a later token does match, and the output is
cut where it starts; such a starting piece is held back like any partial match.
"""

from __future__ import annotations


class StopStringMatcher:
    """Finds a request's stop strings in its streamed output text.

    Args:
        stop: the stop strings (non-empty).
        include_stop_str_in_output: on a match, emit the text up to and including the
            stop string instead of the text before it.

    The first match wins, measured by where the stop string ends (so the result does
    not depend on how the text was chunked); among matches ending at the same place,
    the longer stop string wins.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = list(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        self._held = ""
        self.matched: str | None = None

    def feed(self, new_text: str, *, can_match: bool = True) -> tuple[str, str | None]:
        """Add the next chunk of output text.

        Args:
            new_text: the text the request's newest token(s) added.
            can_match: False for text of the request's first ``min_tokens`` output
                tokens: no stop string may end inside ``new_text`` (now or later); a
                suffix that may begin one is still held back.

        Returns:
            ``(text safe to emit now, matched stop string or None)``. After a match the
            emitted text ends before the stop string (or with it, if asked), the request
            must end, and further calls emit nothing.
        """
        if self.matched is not None:
            return "", None
        text = self._held + new_text
        match = self._find_first_match(text, len(self._held)) if can_match else None
        if match is not None:
            start, stop_str = match
            self.matched = stop_str
            self._held = ""
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            return text[:end], stop_str
        num_held = self._longest_partial_suffix(text)
        self._held = text[len(text) - num_held:]
        return text[:len(text) - num_held], None

    def flush(self) -> str:
        """Release the held-back text; call when the request ends for another reason."""
        held, self._held = self._held, ""
        return held

    def _find_first_match(self, text: str, num_old: int) -> tuple[int, str] | None:
        """Earliest-ending occurrence of a stop string in ``text``.

        ``text[:num_old]`` was held back already: it was searched before, or fed with
        ``can_match=False``, so a match must end inside the new part.
        """
        best: tuple[int, int, str] | None = None  # (end, -length, stop string)
        for stop_str in self.stop:
            start = text.find(stop_str, max(0, num_old - len(stop_str) + 1))
            if start == -1:
                continue
            candidate = (start + len(stop_str), -len(stop_str), stop_str)
            if best is None or candidate < best:
                best = candidate
        if best is None:
            return None
        end, neg_len, stop_str = best
        return end + neg_len, stop_str

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that a stop string starts with."""
        longest = 0
        for stop_str in self.stop:
            for n in range(min(len(stop_str) - 1, len(text)), longest, -1):
                if text.endswith(stop_str[:n]):
                    longest = n
                    break
        return longest
