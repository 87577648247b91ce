"""StopStringMatcher: truncation, hold-back across chunks, streaming consistency."""

from __future__ import annotations

import random

import pytest
from lmkit.text.stop import StopStringMatcher


def stream(matcher: StopStringMatcher, chunks: list[str]) -> tuple[list[str], str | None]:
    deltas = []
    for chunk in chunks:
        emitted, matched = matcher.feed(chunk)
        deltas.append(emitted)
        if matched is not None:
            return deltas, matched
    deltas.append(matcher.flush())
    return deltas, None


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Truncate at the stop string that ends first (the longer one on a tie)."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, neg_len, s = min(found)
    return text[:end if include else end + neg_len], s


def test_stop_in_one_chunk():
    assert StopStringMatcher(["STOP"]).feed("Hello STOP world") == ("Hello ", "STOP")
    assert StopStringMatcher(["STOP"], include_stop_str_in_output=True).feed(
        "Hello STOP world") == ("Hello STOP", "STOP")


def test_stop_spanning_chunks_is_held_back_then_cut():
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello ST") == ("Hello ", None)
    assert m.feed("O") == ("", None)
    assert m.feed("P and more") == ("", "STOP")
    assert m.feed("ignored") == ("", None)  # the request is over
    assert m.matched == "STOP"


def test_false_start_is_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("a ST") == ("a ", None)
    assert m.feed("ART") == ("START", None)
    assert m.feed(" S") == (" ", None)
    assert m.flush() == "S"
    assert m.flush() == ""


def test_overlapping_partial_prefixes():
    m = StopStringMatcher(["aab"])
    assert [m.feed(c) for c in "aaab"] == [("", None), ("", None), ("a", None), ("", "aab")]


def test_first_ending_stop_string_wins():
    m = StopStringMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", "lo w")
    m = StopStringMatcher(["ab", "xabc"])
    assert m.feed("xabc") == ("x", "ab")
    m = StopStringMatcher(["b", "ab"], include_stop_str_in_output=True)
    assert m.feed("zab") == ("zab", "ab")


def test_include_stop_string_across_chunks():
    m = StopStringMatcher(["</answer>"], include_stop_str_in_output=True)
    assert m.feed("42</ans") == ("42", None)
    assert m.feed("wer> tail") == ("</answer>", "</answer>")


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize("include", [False, True])
def test_any_chunking_gives_the_same_text(include):
    rng = random.Random(1234)
    stops = ["\n\nUser:", "###", "END", "日本"]
    texts = [
        "The answer is 42.\n\nUser: more",
        "Some # text ## with ### inside",
        "no stop string here at all, E N D, ##, 日",
        "ENENDEND",
        "日本語 text",
        "trailing partial #",
        "nearly \n\nUser",
    ]
    for text in texts:
        want_text, want_stop = reference(text, stops, include)
        for _ in range(25):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1))))
            chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            deltas, matched = stream(StopStringMatcher(stops, include), chunks)
            streamed = "".join(deltas)
            assert (streamed, matched) == (want_text, want_stop), chunks
            if not include:
                assert not any(s in streamed for s in stops)
