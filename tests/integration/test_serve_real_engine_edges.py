"""Edges of the HTTP server that only the real engine decides, on a tiny random Llama
with the byte tokenizer (one token per UTF-8 byte) and a small chat template:

- a request the engine fails at its first output (constraints that contradict each
  other: a regex and ``allowed_token_ids`` with nothing in common, the request's own
  fault) gets the same HTTP status, 400, streamed as not streamed, not a 200 followed
  by an error event;
- chat ``logprobs`` ``bytes`` are the tokens' raw bytes, so that concatenated they
  rebuild multi-byte text (each byte token decodes alone to U+FFFD).
"""

from __future__ import annotations

import json

import httpx
import pytest
from lmkit.config.schema import LMKitConfig
from serve_live import LiveServer

pytestmark = pytest.mark.slow  # a live server (a few seconds to start)

pytest.importorskip("xgrammar")

MODEL = "tiny"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# digits only, yet only "a" allowed: the first step masks every token
CONFLICT = {"structured_outputs": {"regex": "[0-9]+"}, "allowed_token_ids": [ord("a")]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from lmkit.testing.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-bytes"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    config = LMKitConfig.model_validate({
        "model": {"model": str(path), "max_model_len": 256},
        "scheduler": {"max_num_seqs": 4},
        "server": {"served_model_name": MODEL},
    })
    with LiveServer(config) as live:
        yield live


def post(server, path, body):
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)


def sse_events(server, path, body):
    """(status, parsed events without [DONE], saw [DONE]) of one streaming request."""
    with httpx.stream("POST", f"{server.url}{path}", json={"model": MODEL, **body,
                      "stream": True}, timeout=60) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, [resp.json()], False
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    return 200, [json.loads(d) for d in lines if d != "[DONE]"], lines[-1:] == ["[DONE]"]


@pytest.mark.parametrize("path,base", [
    ("/v1/completions", {"prompt": "N"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "N"}]}),
])
def test_failure_at_first_output_is_an_http_status_when_streaming(server, path, base):
    body = {**base, "max_tokens": 8, "temperature": 0, **CONFLICT}
    plain = post(server, path, body)
    assert plain.status_code == 400
    assert plain.json()["error"]["code"] == "no_allowed_token"
    assert 'regex "[0-9]+" constraint have no token in common' in plain.json()["error"]["message"]
    status, events, _ = sse_events(server, path, body)
    assert status == 400, events  # was 200, then an error event
    assert events[0]["error"]["code"] == "no_allowed_token"
    # the next request, also streamed, is served as usual
    status, events, done = sse_events(server, path, {**base, "max_tokens": 3,
                                                     "temperature": 0})
    assert status == 200 and done
    assert [c["finish_reason"] for e in events for c in e["choices"]
            if c["finish_reason"]] == ["length"]


def test_chat_logprob_bytes_rebuild_multibyte_text(server):
    body = {"messages": [{"role": "user", "content": "Say"}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "structured_outputs": {"regex": "(é|ü|日本)+"}}
    resp = post(server, "/v1/chat/completions", body).json()
    choice = resp["choices"][0]
    text = choice["message"]["content"]
    content = choice["logprobs"]["content"]
    assert len(content) == resp["usage"]["completion_tokens"] == 6
    assert text and all(ch in "éü日本" for ch in text)
    # one token per byte: each non-ASCII byte alone decodes to U+FFFD, but its bytes
    # are the byte itself
    assert all(e["token"] == "\ufffd" and len(e["bytes"]) == 1 for e in content)
    assert bytes(b for e in content for b in e["bytes"]).decode() == text
    for e in content:
        tops = e["top_logprobs"]
        assert tops[0]["bytes"] == e["bytes"] and tops[0]["logprob"] == e["logprob"] <= 0
        assert all(len(t["bytes"]) == 1 for t in tops)
    status, events, done = sse_events(server, "/v1/chat/completions", body)
    assert status == 200 and done
    streamed = [e for ev in events for c in ev["choices"] if c["logprobs"]
                for e in c["logprobs"]["content"]]
    assert [e["bytes"] for e in streamed] == [e["bytes"] for e in content]
