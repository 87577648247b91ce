"""Token logprobs are stored so that holding many costs the garbage collector nothing:
each :class:`TokenLogprob` is an untracked struct of atomic values (the alternatives
packed in two ``bytes``), built so by the sampler and by the engine -> frontend codec,
with every value kept and the OpenAI JSON built from them unchanged."""

from __future__ import annotations

import copy
import gc
import json
import math
import pickle

import msgspec
import pytest
import torch
from lmkit.api.outputs import CompletionOutput, EngineCoreOutput, RequestOutput, TokenLogprob
from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.engine.messages import EngineOutputs, make_encoder, make_frontend_decoder
from lmkit.sample.logprobs import compute_prompt_logprobs, to_token_logprobs
from lmkit.serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from lmkit.worker.step_codec import (
    RunnerOutputWire,
    runner_output_from_wire,
    runner_output_to_wire,
)
from test_serve_formatting import StubTokenizer
from test_serve_large_responses import (
    NUM_TOP,
    TOKENIZER,
    big_output,
    chat_formatter,
    completion_formatter,
)


def _engine_round_trip(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """``outputs`` through the engine-core -> API process channel (msgpack bytes)."""
    data = make_encoder().encode(EngineOutputs(outputs))
    msg = make_frontend_decoder().decode(data)
    assert isinstance(msg, EngineOutputs)
    return msg.outputs


def _sampled(num_rows: int = 6, vocab: int = 50, num_top: int = NUM_TOP
             ) -> tuple[list[TokenLogprob], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logprobs = torch.randn(num_rows, vocab, generator=g).log_softmax(-1)
    logprobs[1, 3] = float("-inf")  # a row with an impossible token
    ids = torch.randint(0, vocab, (num_rows,), generator=g)
    ids[1] = 3
    return to_token_logprobs(ids, logprobs, [num_top] * num_rows), ids, logprobs


def _untracked(lp: TokenLogprob) -> bool:
    """Neither ``lp`` nor any value it holds is tracked by the garbage collector."""
    return not gc.is_tracked(lp) and not any(
        gc.is_tracked(v) for v in msgspec.structs.astuple(lp))


def test_built_logprobs_are_not_tracked_by_the_gc():
    built, _, _ = _sampled()
    by_hand = TokenLogprob(5, -0.25, 1, [(5, -0.25), (2, -1.0)])
    assert all(_untracked(lp) for lp in [*built, by_hand])
    assert by_hand.top == [(5, -0.25), (2, -1.0)]


def test_decoded_logprobs_are_not_tracked_by_the_gc():
    built, ids, _ = _sampled(num_rows=300)
    outs = [EngineCoreOutput(f"r{i}", ids[i:i + 30].tolist(), new_logprobs=built[i:i + 30],
                             prompt_logprobs=[None, *built[i:i + 30]])
            for i in range(0, 300, 30)]
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()  # nothing untracked behind the test's back
    try:
        before = len(gc.get_objects())
        back = _engine_round_trip(outs)
        new_tracked = len(gc.get_objects()) - before
    finally:
        if was_enabled:
            gc.enable()
    decoded = [lp for o in back for lp in [*(o.new_logprobs or ()), *(o.prompt_logprobs or ())]
               if lp is not None]
    assert len(decoded) == 600 and all(_untracked(lp) for lp in decoded)
    # the tracked objects are per output (its lists), none per token or alternative
    assert new_tracked < 10 * len(outs)


def test_engine_codec_round_trip_keeps_every_value():
    built, ids, logprobs = _sampled()
    out = EngineCoreOutput("r", ids.tolist(), new_logprobs=built,
                           prompt_logprobs=[None, *built])
    (back,) = _engine_round_trip([out])
    assert back == out
    for lp, row, tid in zip(back.new_logprobs or [], logprobs, ids.tolist(), strict=True):
        top_lps, top_ids = row.topk(NUM_TOP)
        assert lp.token_id == tid and lp.logprob == row[tid].item()
        assert lp.rank == int((row > row[tid]).sum()) + 1
        assert lp.top == list(zip(top_ids.tolist(), top_lps.tolist(), strict=True))
        assert all(type(t) is int and type(v) is float for t, v in lp.top)
    assert back.new_logprobs is not None and back.new_logprobs[1].logprob == -math.inf
    assert back.prompt_logprobs == [None, *built]


def test_worker_codec_round_trip_keeps_every_value():
    built, ids, _ = _sampled()
    out = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[ids.tolist()],
                            logprobs=[built], prompt_logprobs={"a": [None, *built]})
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(runner_output_to_wire(out)),
                                  type=RunnerOutputWire)
    back = runner_output_from_wire(wire)
    assert back.logprobs == [built] and back.prompt_logprobs == {"a": [None, *built]}
    assert back.logprobs is not None and all(_untracked(lp) for lp in back.logprobs[0])


def test_each_row_keeps_its_own_number_of_alternatives():
    g = torch.Generator().manual_seed(1)
    logprobs = torch.randn(4, 30, generator=g).log_softmax(-1)
    ids = torch.tensor([0, 1, 2, 3])
    rows = to_token_logprobs(ids, logprobs, [0, 3, 1, 5])
    assert [len(lp.top) for lp in rows] == [0, 3, 1, 5]
    for lp, row in zip(rows, logprobs, strict=True):
        top_lps, top_ids = row.topk(len(lp.top))
        assert lp.top == list(zip(top_ids.tolist(), top_lps.tolist(), strict=True))
    prompt = compute_prompt_logprobs(logprobs, ids, 2)
    assert [len(lp.top) for lp in prompt] == [2] * 4


def test_token_logprob_keeps_its_public_face():
    lp = TokenLogprob(token_id=5, logprob=-0.25, rank=2, top=[(5, -0.25), (9, -3.5)])
    assert (lp.token_id, lp.logprob, lp.rank) == (5, -0.25, 2)
    assert lp.top == [(5, -0.25), (9, -3.5)] and lp.top[:1] == [(5, -0.25)]
    assert TokenLogprob(1, -1.0, 1).top == []
    assert list(lp.iter_top(1)) == [(5, -0.25)] and list(lp.iter_top(0)) == []
    assert list(lp.iter_top(99)) == lp.top and lp.num_top == 2
    assert repr(lp) == "TokenLogprob(token_id=5, logprob=-0.25, rank=2, top=[(5, -0.25), (9, -3.5)])"
    assert lp == TokenLogprob(5, -0.25, 2, ((5, -0.25), (9, -3.5)))
    assert lp != TokenLogprob(5, -0.25, 2, [(5, -0.25)])
    assert pickle.loads(pickle.dumps(lp)) == lp and copy.deepcopy(lp) == lp
    with pytest.raises(AttributeError):
        lp.rank = 1  # type: ignore[misc]


def test_bad_values_are_refused_with_what_was_expected():
    with pytest.raises(TypeError, match=r"\(token_id, logprob\) pairs"):
        TokenLogprob(1, -1.0, 1, [1, 2])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="int token_id, a float logprob and an int rank"):
        TokenLogprob(1, "x", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="8 bytes per alternative"):
        TokenLogprob.from_packed(1, -1.0, 1, b"\0" * 8, b"")


def test_formatted_logprobs_are_the_same_values():
    texts = TokenTexts(StubTokenizer())
    pairs = [(7, -0.5), (107, -1.5), (3, float("-inf"))]
    lp = TokenLogprob(7, -0.5, 1, pairs)
    got = completion_logprobs(texts, [None, lp], [1, 7], 2, text_offset=4)
    assert got == {"tokens": ["<1>", "<7>"], "token_logprobs": [None, -0.5],
                   "top_logprobs": [None, {"<7>": -0.5, "<107>": -1.5}],
                   "text_offset": [4, 7]}
    (entry,) = chat_logprobs(texts, [lp], 3)["content"]
    assert entry["top_logprobs"] == [
        {"token": f"<{t}>", "logprob": v if v > -1e4 else -9999.0, "bytes": list(f"<{t}>".encode())}
        for t, v in pairs]


def _through_engine(output: RequestOutput) -> RequestOutput:
    """``output`` with every logprob replaced by its engine-codec round trip."""
    outs = [EngineCoreOutput(str(c.index), c.token_ids, new_logprobs=c.logprobs,
                             prompt_logprobs=output.prompt_logprobs) for c in output.outputs]
    back = _engine_round_trip(outs)
    comps = [CompletionOutput(index=c.index, text=c.text, token_ids=c.token_ids,
                              finish_reason=c.finish_reason, logprobs=b.new_logprobs,
                              delta_text=c.delta_text, delta_token_ids=c.delta_token_ids,
                              delta_logprobs=b.new_logprobs)
             for c, b in zip(output.outputs, back, strict=True)]
    return RequestOutput(output.request_id, output.prompt, output.prompt_token_ids, comps,
                         finished=output.finished, prompt_logprobs=back[0].prompt_logprobs)


def test_openai_responses_from_decoded_logprobs_are_unchanged():
    original = big_output(n=2, num_tokens=40)
    decoded = _through_engine(original)
    for make in (completion_formatter, chat_formatter):
        want = make().response([original])
        assert make().response([decoded]) == want
        assert json.dumps(want)  # plain JSON types only
    want = completion_formatter().response([original])
    first = want["choices"][0]["logprobs"]
    num_prompt = len(original.prompt_token_ids)
    # the first generated token's 20 alternatives, as the test's helper built them
    tid = original.outputs[0].token_ids[0]
    texts = TokenTexts(TOKENIZER)
    expected = {texts((tid + k) % 256): -0.25 * k - 1e-7 * tid for k in range(NUM_TOP)}
    expected.setdefault(texts(tid), -0.5 - tid / 1000)
    assert first["top_logprobs"][num_prompt] == expected
