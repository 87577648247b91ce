"""Stop strings wait for ``min_tokens``, as in vLLM: no stop string may end in the text
of a request's first ``min_tokens`` output tokens, then or later; one that starts there
and is completed by a later token matches and cuts the text where it starts. Covered:
one token per step, several per step (speculative decoding), streamed deltas and the
text held back for a partial match, ``include_stop_str_in_output``, ``n > 1``, the
offline ``LLM`` (generate, stream, speculative) and the API process's ``AsyncLLM``."""

from __future__ import annotations

import asyncio
import random

import pytest
import test_engine_probe_edges as probe
from lmkit import LLM, SamplingParams
from lmkit.api.outputs import EngineCoreOutput, TokenLogprob
from lmkit.api.request import Request
from lmkit.frontend.output_processor import OutputProcessor
from lmkit.testing.tiny_model import make_byte_tokenizer, make_tiny_model
from test_serve_async_llm import collect, harness, run  # noqa: F401 (harness: a fixture)

COMMON = dict(device="cpu", dtype="float32", max_model_len=96, progress=False)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tok():
    return make_byte_tokenizer()


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _lps(ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(token_id=i, logprob=-1.0, rank=1) for i in ids]


def feed(tok, text: str, steps: list[int], max_tokens: int, **params):
    """Run ``text`` (one byte token per character) through an OutputProcessor in steps
    of the given sizes, the last step finishing by length if the engine got there:
    (final CompletionOutput, the deltas streamed, the abort ids)."""
    proc = OutputProcessor(tok)
    proc.add_request(Request("r", [1], SamplingParams(max_tokens=max_tokens, logprobs=0,
                                                      **params)), None)
    ids, deltas, aborts, last, pos = _ids(tok, text), [], [], None, 0
    for size in steps:
        new, pos = ids[pos:pos + size], pos + size
        done = "length" if pos >= max_tokens else None
        step = proc.process_outputs([EngineCoreOutput("r", new, done, new_logprobs=_lps(new))])
        aborts += step.abort_ids
        for out in step.request_outputs:
            (last,) = out.outputs
            deltas.append(last.delta_text)
        if last is not None and last.finish_reason is not None:
            break
    assert not proc.has_unfinished()
    return last, deltas, aborts


def reference(text: str, stops: list[str], min_tokens: int, include: bool):
    """vLLM's rule on one-character tokens: the first stop string (by where it ends,
    the longer on a tie) that ends past the first ``min_tokens`` characters;
    (text, number of tokens kept, stop string) or None."""
    found = [(text.find(s, max(0, min_tokens - len(s) + 1)), s) for s in stops]
    found = [(start + len(s), -len(s), s) for start, s in found if start != -1]
    if not found:
        return None
    end, neg_len, s = min(found)
    return text[:end if include else end + neg_len], end, s


def test_a_stop_string_before_min_tokens_does_not_end_the_request(tok):
    text = "a.b.cd.ef"
    c, deltas, aborts = feed(tok, text, [1] * 9, 9, stop=["."], min_tokens=5)
    # the dots of tokens 2 and 4 are kept; the one of token 7 stops it (was "a" at token 2)
    assert (c.text, c.finish_reason, c.stop_reason) == ("a.b.cd", "stop", ".")
    assert c.token_ids == _ids(tok, text[:7]) and len(c.logprobs) == 7
    assert "".join(deltas) == c.text and aborts == ["r"]
    c, _, _ = feed(tok, text, [1] * 9, 9, stop=["."], min_tokens=5,
                   include_stop_str_in_output=True)
    assert (c.text, c.finish_reason) == ("a.b.cd.", "stop")


def test_a_stop_string_inside_the_first_min_tokens_never_matches_later(tok):
    # "ab" lies in tokens 1-3; after them only new text can end a match
    c, deltas, aborts = feed(tok, "xabcd", [1] * 5, 5, stop=["ab"], min_tokens=3)
    assert (c.text, c.finish_reason, c.stop_reason) == ("xabcd", "length", None)
    assert "".join(deltas) == "xabcd" and aborts == []
    # "ab" is held back whole as the start of "abc", with the complete "b" inside it
    c, _, _ = feed(tok, "abxb", [1] * 4, 4, stop=["abc", "b"], min_tokens=2)
    assert (c.text, c.stop_reason, len(c.token_ids)) == ("abx", "b", 4)


@pytest.mark.parametrize("include,want", [(False, "xy"), (True, "xyab")])
def test_a_stop_string_completed_after_min_tokens_cuts_where_it_starts(tok, include, want):
    c, deltas, aborts = feed(tok, "xyab", [1] * 4, 10, stop=["ab"], min_tokens=3,
                             include_stop_str_in_output=include)
    assert (c.text, c.finish_reason, c.stop_reason) == (want, "stop", "ab")
    assert len(c.token_ids) == 4 and aborts == ["r"]
    assert deltas == ["x", "y", "", want[2:]]  # "a" held back: it may start "ab"


def test_text_held_back_below_min_tokens_is_released_when_the_request_ends(tok):
    # "ab" lies wholly in the first min_tokens == max_tokens tokens: no stop
    c, deltas, aborts = feed(tok, "xab", [1] * 3, 3, stop=["ab"], min_tokens=3)
    assert (c.text, c.finish_reason, aborts) == ("xab", "length", [])
    assert deltas == ["x", "", "ab"]  # "a" held back, then released at the end


def test_a_multi_byte_character_completed_at_min_tokens_is_protected(tok):
    # "é" is two byte tokens; its text arrives with token 2 (of min_tokens=2)
    c, _, _ = feed(tok, "éxé", [1] * 5, 5, stop=["é"], min_tokens=2)
    assert (c.text, c.stop_reason) == ("éx", "é")
    assert c.token_ids == _ids(tok, "éxé")  # the second "é" completed at token 5


@pytest.mark.parametrize("stops", [["."], ["c.", ".."], [".b", "b..c", "e"]])
@pytest.mark.parametrize("include", [False, True])
def test_any_steps_give_the_one_token_per_step_result(tok, stops, include):
    """Speculative decoding's several tokens per step are matched token by token,
    including the steps that cross ``min_tokens``."""
    text = "a.b..c.d.e.f"
    rng = random.Random(0)
    for min_tokens in range(len(text) + 1):
        want = reference(text, stops, min_tokens, include)
        for trial in range(6):
            steps = [1] * len(text) if trial == 0 else \
                [rng.randint(1, 5) for _ in range(len(text))]
            c, deltas, _ = feed(tok, text, steps, len(text), stop=stops,
                                min_tokens=min_tokens, include_stop_str_in_output=include)
            if want is None:
                assert (c.text, c.finish_reason) == (text, "length")
            else:
                assert (c.text, c.finish_reason, c.stop_reason) == (want[0], "stop", want[2])
                assert c.token_ids == _ids(tok, text[:want[1]]), (min_tokens, steps)
                assert [lp.token_id for lp in c.logprobs] == c.token_ids
            assert "".join(deltas) == c.text, (min_tokens, steps)


def test_each_of_n_completions_counts_its_own_tokens(tok):
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=6, n=2, stop=["."], min_tokens=3)
    for i in (0, 1):
        proc.add_request(Request(f"p-{i}", [1], params), None, parent_id="p", index=i, n=2)
    # child 0 gets its tokens one by one, child 1 all at once (a speculative step)
    aborts = []
    for k, ch in enumerate("a.b.cd"):
        step = proc.process_outputs([EngineCoreOutput("p-0", _ids(tok, ch))] + (
            [EngineCoreOutput("p-1", _ids(tok, "..x.y."))] if k == 0 else []))
        aborts += step.abort_ids
        if step.request_outputs[0].finished:
            break
    assert k == 3 and aborts == ["p-1", "p-0"] and not proc.has_unfinished()
    c0, c1 = step.request_outputs[0].outputs
    assert (c0.text, c0.finish_reason, len(c0.token_ids)) == ("a.b", "stop", 4)
    assert (c1.text, c1.finish_reason, len(c1.token_ids)) == ("..x", "stop", 4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-stop-min"))


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny), **COMMON)


PROMPTS = [[7, 70, 170, 17, 77, 177], [200, 20, 2, 102], [97, 98, 99]]


def _repeated_ascii(ids: list[int]) -> tuple[str, int, int]:
    """An ASCII character whose byte token occurs at least twice in ``ids`` (not first):
    (character, its first index, its second index)."""
    for i, t in enumerate(ids[1:], 1):
        if 33 <= t < 127 and t not in ids[:i] and t in ids[i + 1:]:
            return chr(t), i, ids.index(t, i + 1)
    raise AssertionError(f"no repeated ASCII byte in {ids}")


def _cases(llm):
    """Per prompt: (params whose min_tokens covers the stop string's first occurrence,
    the expected token ids and text); and the full greedy outputs."""
    full = llm.generate(PROMPTS, SamplingParams(max_tokens=40, **GREEDY))
    tok = make_byte_tokenizer()
    cases = []
    for o in full:
        ids = list(o.outputs[0].token_ids)
        ch, first, second = _repeated_ascii(ids)
        params = SamplingParams(max_tokens=40, stop=[ch], min_tokens=first + 1, logprobs=0,
                                **GREEDY)
        cases.append((params, ids[:second + 1], tok.decode(ids[:second])))
    return cases, full


def test_llm_generate_and_stream_wait_for_min_tokens(llm):
    cases, _ = _cases(llm)
    outs = llm.generate(PROMPTS, [p for p, _, _ in cases])
    for out, (params, want_ids, want_text) in zip(outs, cases, strict=True):
        (c,) = out.outputs
        assert (c.token_ids, c.text, c.finish_reason) == (want_ids, want_text, "stop")
        chunks = list(llm.stream(out.prompt_token_ids, params))
        assert "".join(ch.outputs[0].delta_text for ch in chunks) == want_text
        assert chunks[-1].outputs[0].token_ids == want_ids and chunks[-1].finished
    assert not llm.engine.has_unfinished_requests()


def test_speculative_steps_wait_for_min_tokens(tiny, llm):
    cases, full = _cases(llm)
    probe.REFERENCES[:] = [p + list(o.outputs[0].token_ids)
                           for p, o in zip(PROMPTS, full, strict=True)]
    spec = LLM(str(tiny), speculative="probe-oracle", num_speculative_tokens=4,
               plugins=[probe.__name__], **COMMON)
    outs = spec.generate(PROMPTS, [p for p, _, _ in cases])
    for out, (_, want_ids, want_text) in zip(outs, cases, strict=True):
        (c,) = out.outputs
        assert (c.token_ids, c.text, c.finish_reason) == (want_ids, want_text, "stop")
        assert [lp.token_id for lp in c.logprobs] == want_ids
    assert spec.stats()["spec_num_accepted_tokens"] > 0


def test_async_llm_streams_wait_for_min_tokens(harness):  # noqa: F811
    make, engine = harness  # scripted: " one two three four ..." one token a step

    async def main():
        llm = await make()
        params = SamplingParams(max_tokens=10, stop=["o"], min_tokens=2, n=2)
        outs = await collect(llm.generate("Hi", params))
        for _ in range(200):  # the aborts reach the engine process on their own
            if len(engine.aborted) == 2:
                break
            await asyncio.sleep(0.01)
        await llm.shutdown()
        return outs

    outs = run(main())
    for c in outs[-1].outputs:  # the "o"s of " one" and " two" are within min_tokens
        assert (c.text, c.finish_reason, c.stop_reason) == (" one two three f", "stop", "o")
        assert "".join(o.outputs[c.index].delta_text for o in outs) == c.text
    assert len(engine.aborted) == 2
