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

The matcher runs in the API process for every output token of every request, so its
cost per character must not grow with the stop strings: they are compiled into one
Aho-Corasick automaton (built once per distinct list and shared, e.g. by the ``n``
completions of a request), whose state after each character is the longest suffix of
the text that begins a stop string. Feeding a character costs amortized O(1) however
many and however long the stop strings are (comparing the text against each stop
string, as a naive matcher does, cost seconds per token for a few hundred long ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


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
        self._automaton = stop_automaton(tuple(self.stop))
        self._state = 0  # the automaton's node for the text so far (0: the root)
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
        automaton = self._automaton
        if self._state == 0 and automaton.first_chars.isdisjoint(new_text):
            return new_text, None  # nothing held and nothing here starts a stop string
        goto, fail, longest = automaton.goto, automaton.fail, automaton.longest
        state = self._state
        for i, char in enumerate(new_text):
            while True:
                nxt = goto[state].get(char)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            stop_str = longest[state] if can_match else None
            if stop_str is not None:
                text = self._held + new_text
                end = len(self._held) + i + 1
                self.matched, self._held, self._state = stop_str, "", 0
                if not self.include_stop_str_in_output:
                    end -= len(stop_str)
                return text[:end], stop_str
        self._state = state
        # held: the longest suffix that is a proper prefix of a stop string; it never
        # reaches past the text held before plus this chunk (that suffix was held then)
        text = self._held + new_text
        num_held = automaton.hold[state]
        self._held = text[len(text) - num_held:] if num_held else ""
        return text[:len(text) - num_held], None

    def flush(self) -> str:
        """Release the held-back text; call when the request ends for another reason."""
        held, self._held, self._state = self._held, "", 0
        return held


@dataclass(frozen=True, slots=True)
class StopAutomaton:
    """An Aho-Corasick automaton over a list of stop strings (node 0 is the root).

    ``goto[node]`` maps a character to the child node; ``fail[node]`` is the node of the
    longest proper suffix of ``node``'s string that is also in the trie; ``longest[node]``
    is the longest stop string that ends ``node``'s string (``None``: none does);
    ``hold[node]`` is the length of the longest suffix of ``node``'s string that is a
    proper prefix of some stop string (text that must be held back);
    ``first_chars`` are the characters that begin a stop string.
    """

    goto: list[dict[str, int]]
    fail: list[int]
    longest: list[str | None]
    hold: list[int]
    first_chars: frozenset[str]


@lru_cache(maxsize=16)
def stop_automaton(stop: tuple[str, ...]) -> StopAutomaton:
    """The automaton of ``stop`` (non-empty strings), built in O(total length) and
    cached: the ``n`` completions of a request, and requests repeating the same stop
    strings, share one."""
    goto: list[dict[str, int]] = [{}]
    ends: list[str | None] = [None]  # the stop string a node spells out in full
    depth = [0]
    for stop_str in stop:
        node = 0
        for char in stop_str:
            nxt = goto[node].get(char)
            if nxt is None:
                nxt = len(goto)
                goto[node][char] = nxt
                goto.append({})
                ends.append(None)
                depth.append(depth[node] + 1)
            node = nxt
        ends[node] = stop_str
    num_nodes = len(goto)
    fail = [0] * num_nodes
    longest: list[str | None] = [None] * num_nodes
    hold = [0] * num_nodes
    order = list(goto[0].values())  # breadth first: a node's fail node comes before it
    for node in order:
        node_fail = fail[node]
        longest[node] = ends[node] if ends[node] is not None else longest[node_fail]
        hold[node] = depth[node] if goto[node] else hold[node_fail]
        for char, child in goto[node].items():
            if node != 0:
                k = node_fail
                while k and char not in goto[k]:
                    k = fail[k]
                fail[child] = goto[k].get(char, 0)
            order.append(child)
    return StopAutomaton(goto, fail, longest, hold, frozenset(goto[0]))
