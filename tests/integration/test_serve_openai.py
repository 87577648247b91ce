"""A live server on loopback driven by the official ``openai`` client, checked against
the offline ``LLM`` on the default model (greedy requests must match token for token).

One server (SmolLM2-135M-Instruct, API key on, 16 running + 16 queued sequences) serves
every test in this module: client flavours, invalid inputs, disconnects, and a bounded
load test with 64 concurrent streaming clients.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from lmkit import LLM, SamplingParams
from lmkit.config.schema import LMKitConfig
from serve_live import LiveServer

pytestmark = pytest.mark.slow  # a live server (16 s to start), 4-20 s per test on 2 cores

KEY = "sk-lmkit-test"
MODEL = "smol"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = LMKitConfig.model_validate({
        "model": {"model": str(smollm2_dir)},
        "scheduler": {"max_num_seqs": 16},
        "server": {"api_key": KEY, "served_model_name": MODEL, "max_queued_requests": 16},
    })
    with LiveServer(config) as live:
        yield live


@pytest.fixture(scope="module")
def offline(smollm2_dir):
    llm = LLM(str(smollm2_dir))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def idle_usage(server):
    return server.wait_idle(0.0)["kv_cache_usage"]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def user(text):
    return [{"role": "user", "content": text}]


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# ------------------------------------------------------------------ openai client


def test_sync_chat_matches_offline_greedy(client, offline):
    expected = offline.chat([user(q) for q in QUESTIONS[:2]], greedy())
    for q, exp in zip(QUESTIONS[:2], expected, strict=True):
        resp = client.chat.completions.create(model=MODEL, messages=user(q), max_tokens=24,
                                              temperature=0)
        choice = resp.choices[0]
        assert choice.message.content == exp.outputs[0].text
        assert choice.finish_reason == exp.outputs[0].finish_reason
        assert resp.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert resp.usage.completion_tokens == len(exp.outputs[0].token_ids)
        assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")


def test_sync_completion_matches_offline_greedy(client, offline):
    prompts = ["The three laws of robotics are", "def fibonacci(n):"]
    expected = offline.generate(prompts, greedy(20))
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=20, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [e.outputs[0].text for e in expected]
    assert resp.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)


def test_async_client_concurrent_requests_match_offline(server, offline):
    expected = offline.chat([user(q) for q in QUESTIONS], greedy(16))

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        resps = await asyncio.gather(*[
            aclient.chat.completions.create(model=MODEL, messages=user(q), max_tokens=16,
                                            temperature=0) for q in QUESTIONS])
        await aclient.close()
        return [r.choices[0].message.content for r in resps]

    assert asyncio.run(main()) == [e.outputs[0].text for e in expected]


def test_streaming_chat_with_usage(client, offline):
    (exp,) = offline.chat([user(QUESTIONS[1])], greedy(24))
    stream = client.chat.completions.create(
        model=MODEL, messages=user(QUESTIONS[1]), max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == exp.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert finishes == [exp.outputs[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        exp.outputs[0].token_ids)
    assert len({c.id for c in chunks}) == 1


def test_streaming_completion_deltas_match_non_streaming(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(**kw, stream=True)
             if c.choices]
    assert "".join(parts) == full


def test_n_samples_are_seeded_and_distinct(client):
    kw = dict(model=MODEL, messages=user("Name a fruit."), max_tokens=12, temperature=1.0,
              n=3, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]  # same seed, same samples
    assert len(set(texts)) > 1
    stream = client.chat.completions.create(**kw, stream=True)
    streamed = {0: "", 1: "", 2: ""}
    for chunk in stream:
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[i] for i in range(3)] == texts


def test_chat_logprobs_match_offline(client, offline):
    (exp,) = offline.chat([user(QUESTIONS[2])], greedy(8, logprobs=3))
    resp = client.chat.completions.create(model=MODEL, messages=user(QUESTIONS[2]), max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 8
    for entry, lp in zip(content, exp.outputs[0].logprobs, strict=True):
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy
        assert bytes(entry.bytes) == entry.token.encode()


def test_completion_logprobs_with_echo(client):
    resp = client.completions.create(model=MODEL, prompt="Paris is the capital of",
                                     max_tokens=4, temperature=0, logprobs=2, echo=True)
    choice = resp.choices[0]
    assert choice.text.startswith("Paris is the capital of")
    lps = choice.logprobs
    n_prompt = resp.usage.prompt_tokens
    assert len(lps.tokens) == n_prompt + 4
    assert lps.token_logprobs[0] is None and all(v is not None for v in lps.token_logprobs[1:])
    assert "".join(lps.tokens) == choice.text
    assert lps.text_offset == sorted(lps.text_offset)


def test_stop_strings_match_offline(client, offline):
    (exp,) = offline.generate(["1, 2, 3, 4,"], greedy(30, stop=[" 7"]))
    resp = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30,
                                     temperature=0, stop=[" 7"])
    choice = resp.choices[0]
    assert " 7" not in choice.text and choice.finish_reason == "stop"
    assert choice.text == exp.outputs[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"],
        stream=True) if c.choices)
    assert streamed == choice.text


def test_models_and_stack(server):
    models = httpx.get(f"{server.url}/v1/models", headers=server.headers).json()
    assert models["data"][0]["id"] == MODEL
    stack = httpx.get(f"{server.url}/v1/lmkit/stack", headers=server.headers).json()
    assert stack["stack"]["scheduler"]["name"] == "fcfs"
    assert stack["stack"]["attention"]["version"]
    assert any(p["name"] for p in stack["plugins"])


def test_metrics_cover_requests_latencies_and_engine(server, client):
    client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=4)
    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
            values.setdefault(name.partition("{")[0], float(value))  # engine="0" etc.
    for name in ("lmkit_time_to_first_token_seconds_count",
                 "lmkit_inter_token_latency_seconds_count",
                 "lmkit_e2e_request_latency_seconds_count", "lmkit_prompt_tokens_total",
                 "lmkit_generation_tokens_total"):
        assert values[name] > 0, name
    assert sum(v for k, v in values.items() if k.startswith("lmkit_requests_total")) > 0
    for name in ("lmkit_num_requests_running", "lmkit_num_requests_waiting",
                 "lmkit_kv_cache_usage_ratio", "lmkit_prefix_cache_hit_rate",
                 "lmkit_num_preemptions_total"):
        assert name in values, name


# ------------------------------------------------------------------ invalid inputs


def _post(server, path, body, headers=None, content=None):
    hdrs = {**server.headers, **(headers or {})}
    if content is not None:
        return httpx.post(f"{server.url}{path}", content=content,
                          headers={**hdrs, "content-type": "application/json"}, timeout=60)
    return httpx.post(f"{server.url}{path}", json=body, headers=hdrs, timeout=60)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
INVALID = [
    ("context_length", "/v1/chat/completions", {**CHAT, "max_tokens": 9000}, 400,
     "context_length_exceeded"),
    ("long_prompt", "/v1/completions", {"model": MODEL, "prompt": "hello " * 9000}, 400,
     "context_length_exceeded"),
    ("n_bound", "/v1/chat/completions", {**CHAT, "n": 500}, 400, None),
    ("top_logprobs_bound", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 50}, 400, None),
    ("min_tokens", "/v1/chat/completions", {**CHAT, "min_tokens": 10}, 400, None),
    ("temperature", "/v1/chat/completions", {**CHAT, "temperature": -0.5}, 400, None),
    ("top_p", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, None),
    ("token_ids", "/v1/completions", {"model": MODEL, "prompt": [1, 10_000_000]}, 400, None),
    ("logit_bias_token", "/v1/chat/completions", {**CHAT, "logit_bias": {"999999": 1}}, 400,
     None),
    ("bad_role", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("unknown_model", "/v1/chat/completions", {**CHAT, "model": "gpt-5"}, 404,
     "model_not_found"),
    ("template_code", "/v1/chat/completions", {**CHAT, "chat_template": "{{ 7 * 7 }}"}, 400,
     "unknown_parameter"),
]


@pytest.mark.parametrize("name,path,body,status,code", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_input_is_4xx_and_server_still_serves(server, name, path, body, status, code):
    resp = _post(server, path, body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code
    ok = _post(server, "/v1/chat/completions", CHAT)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_streaming_invalid_request_keeps_its_status(server):
    resp = _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 9000, "stream": True})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "context_length_exceeded"


def test_auth_and_body_limit(server):
    assert _post(server, "/v1/chat/completions", CHAT,
                 headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # open without a key
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (5 << 20)}]})
    resp = _post(server, "/v1/chat/completions", None, content=big)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0
                      ).models.list()
    assert _post(server, "/v1/chat/completions", CHAT).status_code == 200



# ------------------------------------------------------------------ token constraints


def test_completion_allowed_token_ids_match_offline(client, offline):
    tok = offline.tokenizer
    allowed = sorted(set(tok.encode(" the cat sat on a mat.", add_special_tokens=False)))
    exp = offline.generate([QUESTIONS[3]], greedy(10, allowed_token_ids=allowed,
                                                   ignore_eos=True))[0].outputs[0]
    assert set(exp.token_ids) <= set(allowed) and len(exp.token_ids) == 10
    resp = client.completions.create(model=MODEL, prompt=QUESTIONS[3], max_tokens=10,
                                     temperature=0, extra_body={
                                         "allowed_token_ids": allowed, "ignore_eos": True})
    assert resp.choices[0].text == exp.text


def test_chat_bad_words_match_offline_and_never_appear(client, offline):
    from lmkit.frontend.processor import tokenize_bad_words

    (free,) = offline.chat([user(QUESTIONS[0])], greedy(16))
    assert "Paris" in free.outputs[0].text  # what the ban has to change
    (exp,) = offline.chat([user(QUESTIONS[0])], greedy(16, bad_words=["Paris"]))
    ids = exp.outputs[0].token_ids
    for word in tokenize_bad_words(offline.tokenizer, ["Paris"]):
        assert not any(ids[i:i + len(word)] == word for i in range(len(ids)))
    resp = client.chat.completions.create(model=MODEL, messages=user(QUESTIONS[0]),
                                          max_tokens=16, temperature=0,
                                          extra_body={"bad_words": ["Paris"]})
    assert resp.choices[0].message.content == exp.outputs[0].text


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"allowed_token_ids": [1, 10 ** 6]}, "allowed_token_ids",
     "allowed_token_ids has token ids outside the vocabulary [0, 49152): [1000000]"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids must not be empty"),
    ({"bad_words": [""]}, "bad_words", "bad_words must be non-empty strings"),
    ({"logits_processors": ["nope"]}, "logits_processors", "unknown logits processor 'nope'"),
])
def test_token_constraint_errors_are_400_naming_the_field(server, extra, param, message):
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})):
        resp = _post(server, path, {**body, **extra})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == param and message in err["message"]

# ------------------------------------------------------------------ lifecycle and load


def test_client_disconnect_mid_stream_frees_blocks(server, idle_usage):
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 3000,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body,
                         headers=server.headers) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(200):  # stream until the engine's pushed stats show it running
                assert next(lines) is not None
                busy = server.engine_stats()
                if busy["num_running"] == 1:
                    break
            assert busy["num_running"] == 1 and busy["kv_cache_usage"] > idle_usage
    # the connection is closed mid-stream: the request is aborted and its blocks freed
    server.wait_idle(idle_usage, timeout=10)
    metrics = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    assert 'lmkit_requests_total{outcome="abort"}' in metrics


def test_bounded_load_all_complete_or_429(server, offline, idle_usage):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(8)]
    expected = [o.outputs[0].text for o in offline.generate(prompts, greedy(8))]
    num_clients, per_client = 64, 4

    async def one(http, i):
        body = {"model": MODEL, "prompt": prompts[i % 8], "max_tokens": 8, "temperature": 0,
                "stream": True}
        async with http.stream("POST", f"{server.url}/v1/completions", json=body,
                               headers=server.headers) as resp:
            if resp.status_code == 429:
                assert resp.headers["retry-after"]
                return i, "429", None
            assert resp.status_code == 200
            text, ids, done = "", set(), False
            async for line in resp.aiter_lines():
                if not line:
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                assert "error" not in event, event
                ids.add(event["id"])
                text += "".join(c["text"] for c in event["choices"])
            assert done and len(ids) == 1
            return i, "ok", text

    async def client_loop(http, c):
        return [await one(http, c * per_client + k) for k in range(per_client)]

    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            groups = await asyncio.gather(*[client_loop(http, c) for c in range(num_clients)])
        return [r for g in groups for r in g]

    results = asyncio.run(main())
    assert len(results) == num_clients * per_client  # nothing lost
    ok = [r for r in results if r[1] == "ok"]
    refused = [r for r in results if r[1] == "429"]
    assert len(ok) + len(refused) == len(results)
    assert len(ok) >= 32 and refused  # capacity is 32 sequences: the rest wait or get 429
    for i, _, text in ok:
        assert text == expected[i % 8], f"request {i} got another prompt's answer"
    server.wait_idle(idle_usage, timeout=15)
