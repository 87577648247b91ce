"""A large response body (echo + logprobs over a long prompt, n choices, 20 top
log-probabilities) is built off the event loop, in bounded pieces, with the same bytes:
meanwhile /health and every other request go on."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import msgspec
import pytest
from lmkit.api.outputs import CompletionOutput, RequestOutput, TokenLogprob
from lmkit.serve import handler, routes_chat, routes_completions
from lmkit.serve.logprobs import TokenTexts
from lmkit.serve.protocol import ChatCompletionRequest, CompletionRequest
from lmkit.serve.routes_chat import ChatFormatter
from lmkit.serve.routes_completions import CompletionFormatter
from lmkit.serve.streaming import encode_in_pieces
from lmkit.testing.tiny_model import make_byte_tokenizer
from starlette.responses import JSONResponse
from test_serve_http import make_client

TOKENIZER = make_byte_tokenizer()
PROMPT = "héllo wörld, ünïcode 日本 " * 12  # multi-byte characters: split byte tokens
NUM_TOP = 20


def lp(tid: int, rank: int = 1) -> TokenLogprob:
    top = [((tid + k) % 256, -0.25 * k - 1e-7 * tid) for k in range(NUM_TOP)]
    return TokenLogprob(tid, -0.5 - tid / 1000, rank, top)


def big_output(n: int = 2, num_tokens: int = 200) -> RequestOutput:
    """An output whose JSON with echo and 20 logprobs is far over the off-loop threshold."""
    prompt_ids = TOKENIZER.encode(PROMPT)
    outs = []
    for i in range(n):
        ids = [(7 * i + 13 * k) % 256 for k in range(num_tokens)]
        outs.append(CompletionOutput(
            index=i, text=TOKENIZER.decode(ids), token_ids=ids, finish_reason="length",
            logprobs=[lp(t) for t in ids], delta_text=TOKENIZER.decode(ids),
            delta_token_ids=ids, delta_logprobs=[lp(t) for t in ids]))
    return RequestOutput("r", PROMPT, prompt_ids, outs, finished=True,
                         prompt_logprobs=[None, *(lp(t, 3) for t in prompt_ids[1:])])


def completion_formatter(stream: bool = False, n: int = 2) -> CompletionFormatter:
    body = CompletionRequest(model="tiny", prompt="x", n=n, echo=True, logprobs=NUM_TOP,
                             stream=stream)
    return CompletionFormatter(body, "cmpl-1", "tiny", TokenTexts(TOKENIZER))


def chat_formatter(stream: bool = False, n: int = 2) -> ChatFormatter:
    body = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "x"}],
                                 n=n, logprobs=True, top_logprobs=NUM_TOP, stream=stream)
    return ChatFormatter(body, "chatcmpl-1", "tiny", TokenTexts(TOKENIZER))


def json_render(obj) -> bytes:
    return JSONResponse(obj).body


# -- encoding in pieces ------------------------------------------------------------------

VALUES = [
    [], {}, "", None, True, 0, -0.0, 1e16, 1e-7, -9999.0, 2**63 - 1,
    "é日\u2028\"\\\n", {"k": [1, 2.5, None], "é": {"x": []}},
    [[i, str(i), {"a": i / 3}] for i in range(500)],
    {"choices": [{"index": i, "text": "t" * 3000, "logprobs": {
        "tokens": [chr(65 + k % 26) for k in range(700)],
        "top_logprobs": [None, *({"a": -1.5, "日": -2.0} for _ in range(699))]}}
        for i in range(3)], "usage": {"total_tokens": 9}},
]


@pytest.mark.parametrize("encode", [json_render, msgspec.json.encode], ids=["json", "msgspec"])
@pytest.mark.parametrize("value", VALUES)
def test_pieces_join_to_exactly_one_encoder_call(value, encode):
    pieces = encode_in_pieces(value, encode, max_values=64)
    assert b"".join(pieces) == encode(value)


def test_a_large_value_is_encoded_in_bounded_pieces():
    calls = []

    def encode(obj) -> bytes:
        calls.append(obj)
        return msgspec.json.encode(obj)

    value = VALUES[-1]
    pieces = encode_in_pieces(value, encode, max_values=256)
    assert b"".join(pieces) == msgspec.json.encode(value)
    # no call encodes the whole (each holds the GIL throughout): many small ones
    assert len(calls) > 20 and max(map(len, pieces)) < 8 * 1024


def test_an_iterator_is_built_a_few_items_at_a_time():
    events = []

    def items():
        for i in range(1000):
            events.append("build")
            yield {"i": i, "top": [{"t": "x", "l": -1.0}] * 5}

    def encode(obj) -> bytes:
        events.append("encode")
        return msgspec.json.encode(obj)

    pieces = encode_in_pieces({"choices": items(), "usage": None}, encode, max_values=200)
    expected = {"choices": [{"i": i, "top": [{"t": "x", "l": -1.0}] * 5}
                            for i in range(1000)], "usage": None}
    assert b"".join(pieces) == msgspec.json.encode(expected)
    # encoded in batches as they are built, never all 1000 alive at once
    runs = "".join("b" if e == "build" else " " for e in events).split()
    assert len(runs) > 50 and max(map(len, runs)) < 100
    with pytest.raises(TypeError):  # what the encoder refuses is still refused
        encode_in_pieces([iter([object()])], msgspec.json.encode)


# -- the formatters: same bytes either way -----------------------------------------------

@pytest.fixture
def fixed_clock(monkeypatch):
    monkeypatch.setattr(routes_completions, "created_now", lambda: 1700000000)
    monkeypatch.setattr(routes_chat, "created_now", lambda: 1700000000)


@pytest.mark.parametrize("make", [completion_formatter, chat_formatter])
def test_a_large_response_has_the_same_bytes(make, fixed_clock):
    outputs = [big_output()]
    formatter = make()
    assert sum(formatter.cost(0, o, delta=False) for o in outputs) >= handler.OFF_LOOP_MIN_COST
    expected = JSONResponse(make().response(outputs))
    response = handler.build_json_response(formatter, outputs)
    assert response.body == expected.body
    assert response.raw_headers == expected.raw_headers  # content-length and -type
    json.loads(response.body)


@pytest.mark.parametrize("make", [completion_formatter, chat_formatter])
def test_large_stream_events_have_the_same_bytes(make, fixed_clock):
    a, b = make(stream=True), make(stream=True)
    output = big_output()
    assert a.cost(0, output, delta=True) >= handler.OFF_LOOP_MIN_COST
    assert a.events(0, output, in_pieces=True) == b.events(0, output)


def test_a_large_body_goes_out_in_slices_with_its_whole_length(monkeypatch, fixed_clock):
    monkeypatch.setattr(handler, "SEND_BYTES", 4096)
    response = handler.build_json_response(completion_formatter(), [big_output()])
    messages = []

    async def send(message):
        messages.append(message)

    asyncio.run(response({"type": "http"}, None, send))
    start, *bodies = messages
    headers = dict(start["headers"])
    assert int(headers[b"content-length"]) == len(response.body)
    assert headers[b"content-type"] == b"application/json"
    assert len(bodies) > 10 and all(len(m["body"]) <= 4096 for m in bodies)
    assert b"".join(m["body"] for m in bodies) == response.body
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]


# -- the HTTP server: the loop goes on while a large body is built -----------------------

class FakeLLM:
    """What the generation routes and /health need of an ``AsyncLLM``."""

    can_serve = True
    is_healthy = True
    num_engines = 1
    max_model_len = 2048  # the response cap reads the context length
    engine_stats: list = []
    dead_reason = None

    def __init__(self, output: RequestOutput) -> None:
        self.output = output
        self.tokenizer = TOKENIZER

    async def generate(self, prompt, params, **kwargs):
        yield self.output


class Gate:
    """Wraps a formatter method: records the thread it runs on, and holds it until
    /health has been answered (or ``timeout`` s pass: the loop was blocked)."""

    def __init__(self, method, timeout: float = 3.0) -> None:
        self.method = method
        self.timeout = timeout
        self.started = threading.Event()
        self.health_done = threading.Event()
        self.threads: list[int] = []
        self.released: list[bool] = []

    def install(self, monkeypatch, cls, name: str) -> None:
        def gated(formatter, *args, **kwargs):
            self.threads.append(threading.get_ident())
            self.started.set()
            self.released.append(self.health_done.wait(self.timeout))
            return self.method(formatter, *args, **kwargs)

        monkeypatch.setattr(cls, name, gated)


async def health_while_building(app, path: str, body: dict, gate: Gate):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                 timeout=30) as client:
        post = asyncio.create_task(client.post(path, json=body))
        for _ in range(2000):  # the loop runs while this polls
            if gate.started.is_set() or post.done():
                break
            await asyncio.sleep(0.005)
        health = await client.get("/health")
        gate.health_done.set()
        return health, await post, threading.get_ident()


CASES = [
    ("/v1/completions", CompletionFormatter, "response",
     {"prompt": "x", "echo": True, "logprobs": NUM_TOP, "n": 2}),
    ("/v1/completions", CompletionFormatter, "events",
     {"prompt": "x", "echo": True, "logprobs": NUM_TOP, "n": 2, "stream": True}),
    ("/v1/chat/completions", ChatFormatter, "response",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
      "top_logprobs": NUM_TOP, "n": 2}),
    ("/v1/chat/completions", ChatFormatter, "events",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
      "top_logprobs": NUM_TOP, "n": 2, "stream": True}),
]


@pytest.mark.parametrize("path,cls,method,body", CASES,
                         ids=["completions", "completions-stream", "chat", "chat-stream"])
def test_health_is_answered_while_a_large_body_is_built(monkeypatch, path, cls, method,
                                                        body):
    gate = Gate(getattr(cls, method))
    gate.install(monkeypatch, cls, method)
    client = make_client()
    client.app.state.lmkit.llm = FakeLLM(big_output())
    health, resp, loop_thread = asyncio.run(
        health_while_building(client.app, path, {"model": "tiny", **body}, gate))
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert resp.status_code == 200, resp.text
    # the body was built while /health was answered, not on the event loop's thread
    assert gate.released and all(gate.released), "the event loop was blocked"
    assert loop_thread not in gate.threads
    if body.get("stream"):
        lines = [x for x in resp.text.split("\n\n") if x]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(x[6:]) for x in lines[:-1]]
        assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}
    else:
        assert [c["index"] for c in resp.json()["choices"]] == [0, 1]


def test_a_small_body_is_built_on_the_loop(monkeypatch):
    gate = Gate(CompletionFormatter.response, timeout=0)
    gate.install(monkeypatch, CompletionFormatter, "response")
    client = make_client()
    small = big_output(n=1, num_tokens=3)
    small.prompt_logprobs = None
    client.app.state.lmkit.llm = FakeLLM(small)

    async def post():
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            resp = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                         "max_tokens": 3, "logprobs": 1})
            return resp, threading.get_ident()

    resp, loop_thread = asyncio.run(post())
    assert resp.status_code == 200 and resp.json()["choices"][0]["logprobs"]["tokens"]
    assert gate.threads == [loop_thread]  # no thread hop for a small body
