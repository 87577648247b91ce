"""Valid but unusual uses of the offline engine that once went wrong: streams consumed
while other calls drive the engine, stop strings matched inside a step that accepted
several speculative tokens, and seeded sampling across a preemption."""

from __future__ import annotations

import pytest
from lmkit import LLM, SamplingParams
from lmkit.api import Needs, Proposal, Spec, SpecProposer, hookimpl
from lmkit.api.outputs import EngineCoreOutput, TokenLogprob
from lmkit.api.request import Request
from lmkit.frontend.output_processor import OutputProcessor
from lmkit.testing.tiny_model import make_byte_tokenizer, make_tiny_model

LMKIT_PLUGIN_API = ">=1.0,<2"  # this module is loaded as a plugin (-p)
COMMON = dict(device="cpu", dtype="float32", max_model_len=96, progress=False)
GREEDY = dict(temperature=0.0, ignore_eos=True)
REFERENCES: list[list[int]] = []  # what the oracle proposer drafts from


class OracleDrafts(SpecProposer):
    """Drafts the continuation of the reference sequence the context is a prefix of:
    every draft is accepted, so steps end with several new tokens."""

    def __init__(self, config, options=None):
        pass

    def propose(self, batch):
        drafts = []
        for tokens in batch.token_ids:
            seen = list(tokens)
            ref = next((r for r in REFERENCES if r[:len(seen)] == seen), seen)
            drafts.append(ref[len(seen):len(seen) + batch.num_spec_tokens])
        return Proposal(drafts)


@hookimpl
def register_spec_proposers(register):
    register(Spec(name="probe-oracle", target=lambda: OracleDrafts,
                  stack_needs={"attention": Needs({"multi_token_query"})}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-probe"))


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny), **COMMON)


def _texts(chunks):
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.outputs:
            texts[c.index] = texts.get(c.index, "") + c.delta_text
    return texts


def test_a_stream_gets_its_outputs_while_another_stream_drives_the_engine(llm):
    long_params = SamplingParams(max_tokens=20, **GREEDY)
    short_params = SamplingParams(max_tokens=3, **GREEDY)
    want = llm.generate(["a long one", "short"], [long_params, short_params])
    first, second = llm.stream("a long one", long_params), llm.stream("short", short_params)
    chunks = [next(second)]
    assert list(first)[-1].outputs[0].token_ids == want[0].outputs[0].token_ids
    chunks += list(second)  # finished while the first stream stepped the engine
    assert [len(c.outputs[0].token_ids) for c in chunks] == [1, 2, 3]
    assert chunks[-1].finished and chunks[-1].outputs[0].finish_reason == "length"
    assert chunks[-1].outputs[0].token_ids == want[1].outputs[0].token_ids
    assert _texts(chunks) == {0: want[1].outputs[0].text}
    assert not llm.engine.has_unfinished_requests()


def test_a_stream_open_across_generate_keeps_its_deltas(llm):
    stream_params = SamplingParams(max_tokens=12, n=2, **GREEDY)
    gen_params = SamplingParams(max_tokens=12, **GREEDY)
    want = llm.generate(["streamed", "generated"], [stream_params, gen_params])
    stream = llm.stream("streamed", stream_params)
    chunks = [next(stream)]
    (out,) = llm.generate(["generated"], gen_params)
    assert out.outputs[0].text == want[1].outputs[0].text
    assert (out.outputs[0].delta_text, out.outputs[0].delta_token_ids) == ("", [])
    assert not chunks[0].finished
    chunks += list(stream)
    assert chunks[-1].finished
    text = want[0].outputs[0].text
    assert _texts(chunks) == {0: text, 1: text}
    assert not llm.engine.has_unfinished_requests()


def test_a_stop_string_inside_a_multi_token_step_cuts_the_token_ids_too():
    tok = make_byte_tokenizer()
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=10, logprobs=0, stop=["cd"])
    proc.add_request(Request("r", tok.encode("hi"), params), "hi")
    ids = tok.encode("abcdef")
    lps = [TokenLogprob(token_id=i, logprob=-1.0, rank=1) for i in ids]
    step = proc.process_outputs([EngineCoreOutput("r", ids, new_logprobs=lps)])
    (c,) = step.request_outputs[0].outputs
    assert (c.text, c.finish_reason, c.stop_reason) == ("ab", "stop", "cd")
    assert c.token_ids == c.delta_token_ids == ids[:4]  # up to the token completing "cd"
    assert [lp.token_id for lp in c.logprobs] == ids[:4]
    assert step.abort_ids == ["r"]


def test_speculative_steps_past_a_stop_string_give_the_plain_tokens(tiny, llm):
    prompts = [[7, 70, 170, 17, 77, 177], [200, 20, 2, 102]]
    full = llm.generate(prompts, SamplingParams(max_tokens=40, **GREEDY))
    REFERENCES[:] = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, full, strict=True)]
    params = []
    for o in full:  # stop at the first new ASCII character from the fifth on
        text = o.outputs[0].text
        k = next(i for i in range(4, len(text)) if text[i].isascii() and text[i] not in text[:i])
        params.append(SamplingParams(max_tokens=40, stop=[text[k]], logprobs=1, **GREEDY))
    plain = llm.generate(prompts, params)
    spec = LLM(str(tiny), speculative="probe-oracle", num_speculative_tokens=4,
               plugins=[__name__], **COMMON)
    for out, want in zip(spec.generate(prompts, params), plain, strict=True):
        (c,), (w,) = out.outputs, want.outputs
        assert (c.text, c.finish_reason, c.stop_reason) == (w.text, "stop", w.stop_reason)
        assert c.token_ids == w.token_ids and len(w.token_ids) < 40
        assert [lp.token_id for lp in c.logprobs] == w.token_ids
    assert spec.stats()["spec_num_accepted_tokens"] > 0


def test_seeded_samples_survive_preemption(tiny, llm):
    prompts = [[(31 * i + 7 * j) % 256 for j in range(4 + 5 * i)] for i in range(6)]
    params = [SamplingParams(temperature=1.0, top_k=(0, 20)[i % 2], max_tokens=60 - len(p),
                             ignore_eos=True, seed=100 + i, n=1 + i % 2)
              for i, p in enumerate(prompts)]
    alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    tight = LLM(str(tiny), num_blocks=8, block_size=16, **{**COMMON, "max_model_len": 64})
    crowded = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    for out, want in zip(crowded, alone, strict=True):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
