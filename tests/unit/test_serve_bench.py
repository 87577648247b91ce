"""``lmkit bench serve`` measurement: SSE parsing per request, statistics, the report."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from lmkit.benchmarking.serve import RequestResult, _one_request, format_serve_report, summarize


def sse_body(texts, usage):
    events = [{"choices": [{"index": 0, "text": t}]} for t in texts]
    events.append({"choices": [], "usage": usage})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def run_one(handler, **kw):
    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await _one_request(client, "http://x", "m", [1, 2, 3], 3, "key")
    return asyncio.run(main())


def test_one_request_measures_tokens_and_latencies():
    seen = {}

    def handler(request):
        seen["body"] = json.loads(request.content)
        seen["auth"] = request.headers["authorization"]
        return httpx.Response(200, text=sse_body(["a", "b", "c"], {"completion_tokens": 3}),
                              headers={"content-type": "text/event-stream"})

    r = run_one(handler)
    assert r.ok and r.output_tokens == 3 and r.prompt_tokens == 3
    assert r.ttft is not None and len(r.itls) == 2 and r.e2e >= r.ttft
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 2)
    assert seen["auth"] == "Bearer key"
    body = seen["body"]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 3 and body["ignore_eos"]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}


def test_chunks_with_empty_text_count_as_tokens():
    # a random-weight model's tokens often decode to no text: each chunk with a choice
    # is still a token event (first token, inter-token gaps); the usage chunk is not
    r = run_one(lambda req: httpx.Response(200, text=sse_body(["", "", "x", ""], {
        "completion_tokens": 4}), headers={"content-type": "text/event-stream"}))
    assert r.ok and r.output_tokens == 4
    assert r.ttft is not None and len(r.itls) == 3


def test_one_request_records_http_and_stream_errors():
    r = run_one(lambda req: httpx.Response(429, text='{"error": {"message": "busy"}}'))
    assert not r.ok and r.error.startswith("HTTP 429")
    err = 'data: {"error": {"message": "engine died"}}\n\n'
    r = run_one(lambda req: httpx.Response(200, text=err))
    assert not r.ok and r.error == "engine died"


def test_summarize_and_report():
    results = [RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1,
                             itls=[0.02, 0.04], e2e=0.2),
               RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.3,
                             itls=[0.02], e2e=0.5),
               RequestResult(ok=False, error="HTTP 429: busy")]
    run = summarize("concurrency=2", results, elapsed_s=2.0)
    assert run["completed"] == 2 and run["failed"] == 1
    assert run["errors"] == {"HTTP 429: busy": 1}
    assert run["requests_per_s"] == 1.0 and run["output_tokens_per_s"] == 5.0
    assert run["total_tokens_per_s"] == 15.0
    assert run["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert run["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert run["itl_ms"]["mean"] == pytest.approx(80 / 3)
    assert run["tpot_ms"]["mean"] == pytest.approx((25.0 + 50.0) / 2)
    text = format_serve_report({"url": "http://x", "model": "m", "workload": "w",
                                "runs": [run]})
    assert "concurrency=2" in text and "1 x HTTP 429: busy" in text
    empty = summarize("rate=1/s", [RequestResult(ok=False, error="x")], 1.0)
    assert empty["ttft_ms"]["mean"] is None and "rate=1/s" in format_serve_report(
        {"url": "u", "model": "m", "workload": "w", "runs": [empty]})
