"""OpenAI JSON from engine outputs: chunk sequences, usage, logprobs shapes, SSE framing."""

from __future__ import annotations

import json

from lmkit.api.outputs import CompletionOutput, RequestOutput, TokenLogprob
from lmkit.serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from lmkit.serve.protocol import ChatCompletionRequest, CompletionRequest
from lmkit.serve.routes_chat import ChatFormatter
from lmkit.serve.routes_completions import CompletionFormatter
from lmkit.serve.streaming import SSE_DONE, sse


class StubTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


def lp(tid, value=-0.5):
    return TokenLogprob(tid, value, 1, [(tid, value), (tid + 100, value - 1)])


def out(deltas, finish=None, prompt_ids=(1, 2, 3), prompt="P", finished=None, prompt_lps=None):
    """deltas: per completion index, (delta token ids, delta text, cumulative ids)."""
    outs = []
    for i, (ids, text, cum) in enumerate(deltas):
        outs.append(CompletionOutput(
            index=i, text="".join(f"<{t}>" for t in cum), token_ids=list(cum),
            finish_reason=(finish or [None] * len(deltas))[i],
            logprobs=[lp(t) for t in cum], delta_text=text, delta_token_ids=list(ids),
            delta_logprobs=[lp(t) for t in ids]))
    done = all(c.finish_reason for c in outs) if finished is None else finished
    return RequestOutput("r", prompt, list(prompt_ids), outs, finished=done,
                         prompt_logprobs=prompt_lps)


def test_chat_stream_chunk_sequence_with_usage():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                 n=2, stream=True, stream_options={"include_usage": True})
    f = ChatFormatter(body, "chatcmpl-1", "m", TokenTexts(StubTokenizer()))
    chunks = f.chunks(0, out([([7], "<7>", [7]), ([8], "<8>", [8])]))
    chunks += f.chunks(0, out([([9], "<9>", [7, 9]), ([], "", [8])], finish=["length", "stop"]))
    chunks += f.final_chunks()
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1" for c in chunks)
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert [c["choices"][0]["index"] for c in roles] == [0, 1]
    assert roles[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks[:-1]:
        assert c["usage"] is None  # include_usage: null on every chunk but the last
        (choice,) = c["choices"]
        text[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            assert choice["delta"] == {}
            finish[choice["index"]] = choice["finish_reason"]
    assert text == {0: "<7><9>", 1: "<8>"} and finish == {0: "length", 1: "stop"}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_chat_response_and_logprobs():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                 logprobs=True, top_logprobs=1)
    f = ChatFormatter(body, "chatcmpl-2", "m", TokenTexts(StubTokenizer()))
    resp = f.response([out([([5, 6], "<5><6>", [5, 6])], finish=["stop"])])
    (choice,) = resp["choices"]
    assert resp["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": "<5><6>", "refusal": None}
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == ["<5>", "<6>"]
    assert content[0]["bytes"] == list(b"<5>") and content[0]["logprob"] == -0.5
    assert content[0]["top_logprobs"] == [{"token": "<5>", "logprob": -0.5, "bytes": list(b"<5>")}]
    assert resp["usage"]["total_tokens"] == 5


def test_completion_echo_logprobs_and_batch_indices():
    body = CompletionRequest(model="m", prompt=["a", "b"], n=2, echo=True, logprobs=1)
    f = CompletionFormatter(body, "cmpl-1", "m", TokenTexts(StubTokenizer()))
    prompt_lps = [None, lp(2), lp(3)]
    o = out([([4], "<4>", [4]), ([5], "<5>", [5])], finish=["stop", "length"], prompt="P",
            prompt_lps=prompt_lps)
    resp = f.response([o, o])
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    first = resp["choices"][0]
    assert first["text"] == "P<4>"
    lps = first["logprobs"]
    assert lps["tokens"] == ["<1>", "<2>", "<3>", "<4>"]
    assert lps["token_logprobs"] == [None, -0.5, -0.5, -0.5]
    assert lps["top_logprobs"][0] is None and lps["top_logprobs"][3] == {"<4>": -0.5}
    assert lps["text_offset"][3] == len("P")
    assert resp["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}


def test_completion_stream_sends_finish_reason_once():
    body = CompletionRequest(model="m", prompt="a", stream=True)
    f = CompletionFormatter(body, "cmpl-2", "m", TokenTexts(StubTokenizer()))
    c1 = f.chunks(0, out([([4], "<4>", [4])], finished=False))
    c2 = f.chunks(0, out([([], "", [4])], finish=["stop"]))
    c3 = f.chunks(0, out([([], "", [4])], finish=["stop"]))
    assert [c["choices"][0]["text"] for c in c1] == ["<4>"]
    assert [c["choices"][0]["finish_reason"] for c in c2] == ["stop"]
    assert c3 == [] and f.final_chunks() == []
    assert "usage" not in c1[0]


def test_logprob_helpers_handle_infinities():
    texts = TokenTexts(StubTokenizer())
    got = completion_logprobs(texts, [TokenLogprob(1, float("-inf"), 9, [])], [1], 0)
    assert got["token_logprobs"] == [-9999.0]
    assert chat_logprobs(texts, [TokenLogprob(1, float("-inf"), 9, [])], 0)["content"][0][
        "logprob"] == -9999.0


def test_sse_framing():
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert json.loads(sse({"x": "é"})[6:-2]) == {"x": "é"}
    assert SSE_DONE == b"data: [DONE]\n\n"
