"""One request must not make every other request wait: the per-request costs that run
on a shared path (the API process's event loop and output processor, the engine's step)
are bounded, and a request past a bound is refused with a 400 naming the field.

- stop strings: matched through one automaton per distinct list (shared by the ``n``
  completions), so the cost per output character does not grow with the stop strings
  (hundreds of long ones cost the output processor seconds per token, stalling every
  stream); their number and length are bounded;
- ``allowed_token_ids``, ``stop_token_ids``, ``logit_bias``, ``bad_words``: bounded
  (they are turned into tensors or checked at every engine step of every row);
  bad words are tokenized once per request (not once per completion), in linear time;
- structured-output constraints: counted repetitions that compilers expand (a
  20-character schema pattern compiled for minutes, starving the other requests'
  compilations) are refused before compiling; the size bound is checked before the
  costlier checks that run on the event loop.
"""

from __future__ import annotations

import random

import pytest
from lmkit.api.sampling_params import (
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_IDS,
    SamplingParams,
)
from lmkit.errors import InvalidRequestError
from lmkit.frontend.processor import InputProcessor, child_params, tokenize_bad_words
from lmkit.serve.protocol import ChatCompletionRequest, CompletionRequest
from lmkit.structured.constraint import (
    MAX_NESTED_REPEAT,
    MAX_REPEAT,
    MAX_REPEAT_TOTAL,
    counted_repetitions,
    validate_structured_outputs,
)
from lmkit.testing.tiny_model import make_byte_tokenizer
from lmkit.text.stop import StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer():
    return make_byte_tokenizer()


def refused(param: str, match: str, **kwargs) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError, match=match) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and info.value.code == "invalid_value"
    return info.value


# -- stop strings ------------------------------------------------------------------------


def test_stop_string_count_and_length_are_bounded():
    SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])
    refused("stop", f"has {MAX_STOP_STRINGS + 1} stop strings; at most {MAX_STOP_STRINGS}",
            stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    SamplingParams(stop=["x" * MAX_STOP_CHARS])
    refused("stop", f"holds {MAX_STOP_CHARS + 1} characters in all; at most {MAX_STOP_CHARS}",
            stop=["x" * (MAX_STOP_CHARS // 2), "y" * (MAX_STOP_CHARS // 2 + 1)])


def test_stop_strings_are_counted_before_each_is_looked_at():
    # 10,000 non-strings: refused for their number, the message does not list them
    error = refused("stop", "at most", stop=[1] * 10_000)
    assert len(str(error)) < 300


def test_equal_stop_lists_share_one_automaton():
    """The n completions of a request build the matcher's automaton once."""
    stops = ["\n\nUser:", "###", "END"]
    first, second = StopStringMatcher(list(stops)), StopStringMatcher(list(stops), True)
    assert first._automaton is second._automaton


def naive_match(chunks: list[tuple[str, bool]], stops: list[str], include: bool):
    """The text to emit and the stop string, computed from the whole text: the first
    stop string to end (the longer on a tie) in text fed with ``can_match``."""
    text, matchable = "", []
    for chunk, can_match in chunks:
        text += chunk
        matchable += [can_match] * len(chunk)
    best = None
    for stop in stops:
        start = text.find(stop)
        while start != -1:
            end = start + len(stop)
            if matchable[end - 1]:
                if best is None or (end, -len(stop)) < (best[0], -len(best[1])):
                    best = (end, stop)
                break
            start = text.find(stop, start + 1)
    if best is None:
        return text, None
    end, stop = best
    return text[:end if include else end - len(stop)], stop


@pytest.mark.parametrize("include", [False, True])
def test_matcher_agrees_with_a_whole_text_search(include):
    rng = random.Random(7)
    for _ in range(3000):
        stops = list({"".join(rng.choice("ab") for _ in range(rng.randint(1, 4)))
                      for _ in range(rng.randint(1, 4))})
        chunks = [("".join(rng.choice("abc") for _ in range(rng.randint(0, 4))), i >= 2)
                  for i in range(rng.randint(1, 6))]
        matcher = StopStringMatcher(stops, include)
        emitted, matched = "", None
        for chunk, can_match in chunks:
            out, matched = matcher.feed(chunk, can_match=can_match)
            emitted += out
            if matched is not None:
                break
        if matched is None:
            emitted += matcher.flush()
        assert (emitted, matched) == naive_match(chunks, stops, include), (stops, chunks)


def test_a_long_partial_match_is_held_back_and_released():
    stops = ["a" * 63 + "b", *("c" * 63 + chr(0x100 + i) for i in range(100))]
    matcher = StopStringMatcher(stops)
    assert [matcher.feed("a") for _ in range(100)] == [("", None)] * 63 + [("a", None)] * 37
    assert matcher.feed("b") == ("", stops[0])  # the held "a"s begin the stop string


# -- token lists ---------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["allowed_token_ids", "stop_token_ids"])
def test_token_id_lists_are_bounded(field):
    SamplingParams(**{field: list(range(MAX_TOKEN_IDS))})
    refused(field, f"has {MAX_TOKEN_IDS + 1} token ids; at most {MAX_TOKEN_IDS} are allowed",
            **{field: [0] * (MAX_TOKEN_IDS + 1)})


def test_logit_bias_entries_are_bounded_in_params_and_protocol():
    SamplingParams(logit_bias={i: 1.0 for i in range(MAX_TOKEN_IDS)})
    refused("logit_bias", f"has {MAX_TOKEN_IDS + 1} entries; at most {MAX_TOKEN_IDS}",
            logit_bias={i: 1.0 for i in range(MAX_TOKEN_IDS + 1)})
    body = CompletionRequest(model="m", prompt="x",
                             logit_bias={str(i): 1 for i in range(MAX_TOKEN_IDS + 1)})
    with pytest.raises(InvalidRequestError, match="at most 2048 are allowed") as info:
        body.to_sampling_params()
    assert info.value.param == "logit_bias"


def test_bad_words_are_bounded():
    SamplingParams(bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS)])
    refused("bad_words", f"has {MAX_BAD_WORDS + 1} words; at most {MAX_BAD_WORDS}",
            bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS + 1)])
    refused("bad_words", f"holds {MAX_BAD_WORDS_CHARS + 1} characters in all",
            bad_words=["x" * MAX_BAD_WORDS_CHARS, "y"])


def test_bad_words_are_tokenized_once_per_request(tokenizer):
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode(self, text, **kwargs):
            calls.append(text)
            return tokenizer.encode(text, **kwargs)

    processor = InputProcessor(Counting(), 64, 257, (256,))
    params = SamplingParams(n=8, bad_words=["alpha", "beta"])
    requests = [processor.make_request(f"r-{i}", [1], child_params(params, i))
                for i in range(8)]
    assert len(calls) == 4  # two words, each as is and after a space: once, not 8 times
    want = [tokenizer.encode(t, add_special_tokens=False)
            for t in ("alpha", " alpha", "beta", " beta")]
    assert all(r.sampling_params.bad_words_token_ids == want for r in requests)
    requests[0].sampling_params.bad_words_token_ids[0].append(0)  # copies, not shared
    assert requests[1].sampling_params.bad_words_token_ids == want


def test_tokenized_bad_words_keep_their_order_without_duplicates(tokenizer):
    ids = tokenize_bad_words(tokenizer, ["b", "a", " b", "a", "b c"])
    encode = [tokenizer.encode(t, add_special_tokens=False)
              for t in ("b", " b", "a", " a", "b c", " b c")]
    assert ids == encode


# -- structured-output constraints --------------------------------------------------------


@pytest.mark.parametrize(("pattern", "expected"), [
    ("^[a-z]{0,30000}$", [("{0,30000}", 30000, 30000)]),
    ("^([a-z]{1,30}){1,30}$", [("{1,30}", 30, 30), ("{1,30}", 30, 900)]),
    (r"^(\d{1,3}\.){3}\d{1,3}$", [("{1,3}", 3, 3), ("{3}", 3, 9), ("{1,3}", 3, 3)]),
    ("((a{1,3}){1,3}){1,3}", [("{1,3}", 3, 3), ("{1,3}", 3, 9), ("{1,3}", 3, 27)]),
    ("(a{2})+b{3,}c{,4}", [("{2}", 2, 2), ("{3,}", 3, 3), ("{,4}", 4, 4)]),
    (r"\{5\}x{a}[{]{2}[]{]{3}", [("{2}", 2, 2), ("{3}", 3, 3)]),  # literal braces
    ("a{" + "9" * 5000 + "}", [("{" + "9" * 5000 + "}", 10**18, 10**18)]),
])
def test_counted_repetitions_of_a_regex(pattern, expected):
    assert counted_repetitions(pattern) == expected


def too_complex(constraint, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        validate_structured_outputs(constraint, 32768)
    assert info.value.code == "constraint_too_complex"
    assert info.value.param == "structured_outputs"


def string_with(pattern: str) -> dict:
    return {"json": {"type": "string", "pattern": pattern}}


def test_explosive_counted_repetitions_are_refused_before_compiling():
    too_complex(string_with("^[a-z]{0,30000}$"),
                rf"'\^\[a-z\]\{{0,30000\}}\$' repeats \{{0,30000\}}: .* at most {MAX_REPEAT}")
    too_complex({"regex": "[0-9]{100000}"}, "at most 1000 times")
    too_complex(string_with("^([a-z]{1,30}){1,30}$"),
                f"to 900 repetitions; nested counts may multiply to at most {MAX_NESTED_REPEAT}")
    props = {f"p{i}": {"type": "string", "pattern": "[a-z]{3,30}[0-9]{2,20}"}
             for i in range(100)}
    too_complex({"json": {"type": "object", "properties": props}},
                f"repeat 5000 times in all .* at most {MAX_REPEAT_TOTAL}")
    too_complex({"json": {"type": "object", "patternProperties": {"^a{5000}$": {}}}},
                "repeats")
    # a property named like a value keyword is still a schema
    too_complex({"json": {"properties": {"enum": string_with("a{5000}")["json"]}}}, "repeats")
    too_complex({"structural_tag": {"type": "structural_tag", "format": {
        "type": "regex", "pattern": "x{2000}"}}}, "repeats")


@pytest.mark.parametrize("constraint", [
    string_with(r"^(\d{1,3}\.){3}\d{1,3}$"),
    string_with(f"^[A-Za-z0-9]{{1,{MAX_REPEAT}}}$"),
    string_with("^([a-z]{1,10}){1,10}$"),
    {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"},
    {"json": {"enum": [{"pattern": "a{5000}"}], "default": {"pattern": "b{9999}"}}},
    {"grammar": 'root ::= [a-z]{0,5000}'},  # grammars compile counted repetitions cheaply
])
def test_common_patterns_are_accepted(constraint):
    validate_structured_outputs(constraint, 32768)


def test_constraint_size_is_checked_before_the_costlier_checks(monkeypatch):
    """A schema of megabytes is refused for its size without being walked or copied on
    the event loop (walking one of 3.7 MB took 3.4 s)."""
    import lmkit.structured.constraint as constraint
    import lmkit.structured.schema_check as schema_check

    walked = []
    monkeypatch.setattr(schema_check, "endless_schema_error", walked.append)
    monkeypatch.setattr(constraint, "_check_nesting", lambda kind, spec: walked.append(spec))
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": big}}}
    with pytest.raises(InvalidRequestError, match="at most 1000 characters") as info:
        ChatCompletionRequest.model_validate(body).to_sampling_params(max_constraint_chars=1000)
    assert info.value.code == "constraint_too_large" and info.value.param == "response_format"
    assert walked == []
    params = ChatCompletionRequest.model_validate(body).to_sampling_params()  # no limit
    assert params.structured_outputs == {"json": big} and len(walked) == 2


@pytest.mark.parametrize("path,base", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
])
def test_the_routes_check_a_constraints_size_before_walking_it(monkeypatch, path, base):
    """Both generation routes pass structured_output.max_constraint_chars to
    to_sampling_params, so a huge constraint is refused before anything walks it."""
    import lmkit.structured.constraint as constraint
    from lmkit.config.schema import LMKitConfig
    from lmkit.serve.app import build_app
    from starlette.testclient import TestClient
    from test_serve_http import assert_openai_error

    walked = []
    monkeypatch.setattr(constraint, "_check_nesting", lambda kind, spec: walked.append(spec))
    config = LMKitConfig.model_validate({"model": {"model": "tiny"},
                                         "structured_output": {"max_constraint_chars": 1000}})
    client = TestClient(build_app(config))
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    body = {"model": "tiny", **base,
            "response_format": {"type": "json_schema", "json_schema": {"schema": big}}}
    assert_openai_error(client.post(path, json=body), 400, code="constraint_too_large")
    assert walked == []


def test_the_constraint_is_not_copied():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x",
                                             "structured_outputs": {"json": schema}})
    assert body.to_sampling_params().structured_outputs["json"] is body.structured_outputs.json_
