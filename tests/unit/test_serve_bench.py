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


# ---- the run schedule and several client processes ---------------------------------

from lmkit.benchmarking.serve import (  # noqa: E402
    Share,
    ShareResult,
    arrival_offsets,
    merge_shares,
    run_serve_bench,
    run_share,
    split_run,
)
from lmkit.benchmarking.workload import random_workload  # noqa: E402
from lmkit.errors import LMKitError  # noqa: E402


def test_arrival_offsets_are_the_seeded_poisson_schedule():
    import random

    rng = random.Random(7)
    expected, t = [], 0.0
    for _ in range(5):
        expected.append(t)
        t += rng.expovariate(4.0)
    assert arrival_offsets(5, 4.0, seed=7) == expected
    assert arrival_offsets(3, float("inf"), seed=7) == [0.0, 0.0, 0.0]


def test_split_run_deals_requests_clients_and_arrival_times():
    wl = random_workload(10, (4, 8), (2, 5), vocab_size=50, seed=1)
    shares = split_run(wl, 3, concurrency=5)
    assert [s.concurrency for s in shares] == [2, 2, 1]
    assert [len(s.prompts) for s in shares] == [4, 3, 3]
    assert shares[1].prompts == wl.prompts[1::3] and shares[1].output_lens == wl.output_lens[1::3]
    assert all(s.offsets is None for s in shares)
    # fewer clients than processes: a process with no client is dropped
    assert [s.concurrency for s in split_run(wl, 4, concurrency=2)] == [1, 1]
    # open loop: every request keeps its one-process arrival time
    full = arrival_offsets(10, 2.0, seed=3)
    shares = split_run(wl, 3, rate=2.0, seed=3, max_concurrency=4)
    assert sorted(o for s in shares for o in s.offsets) == sorted(full)
    assert shares[2].offsets == full[2::3] and [s.concurrency for s in shares] == [2, 1, 1]
    assert [s.concurrency for s in split_run(wl, 2, rate=2.0)] == [None, None]
    with pytest.raises(ValueError, match="exactly one"):
        split_run(wl, 2, concurrency=2, rate=1.0)


def _sse_handler(in_flight, peak):
    async def handler(request):
        body = json.loads(request.content)
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await asyncio.sleep(0.02)
        in_flight[0] -= 1
        n = body["max_tokens"]
        return httpx.Response(200, text=sse_body(["t"] * n, {"completion_tokens": n}),
                              headers={"content-type": "text/event-stream"})
    return handler


def _run_mock_share(share, start=None):
    in_flight, peak = [0], [0]

    async def main():
        transport = httpx.MockTransport(_sse_handler(in_flight, peak))
        async with httpx.AsyncClient(transport=transport) as client:
            return await run_share(client, "http://x", "m", share, None, start)
    return asyncio.run(main()), peak[0]


def test_run_share_closed_loop_keeps_its_clients_busy():
    share = Share(prompts=[[1]] * 6, output_lens=[3] * 6, offsets=None, concurrency=2)
    done, peak = _run_mock_share(share)
    assert peak == 2 and len(done.results) == 6
    assert all(r.ok and r.output_tokens == 3 for r in done.results)
    assert done.end > done.start and done.cpu_s >= 0


def test_run_share_open_loop_sends_on_schedule_under_its_cap():
    import time

    offsets = [0.0, 0.0, 0.0, 0.15]
    share = Share(prompts=[[1]] * 4, output_lens=[2] * 4, offsets=offsets, concurrency=2)
    start = time.monotonic()
    done, peak = _run_mock_share(share, start)
    assert peak == 2 and len(done.results) == 4 and done.start == start
    # the last request could not start before its arrival time
    assert done.end - start >= 0.15


def test_merge_shares_spans_all_processes():
    def res(start, end, cpu):
        return ShareResult([RequestResult(ok=True, prompt_tokens=2, output_tokens=4,
                                          ttft=0.1, itls=[0.1] * 3, e2e=0.4)],
                           start, end, cpu)
    run = merge_shares("rate=inf/s", [res(10.0, 12.0, 1.9), res(10.5, 14.0, 0.7)])
    assert run["elapsed_s"] == pytest.approx(4.0) and run["completed"] == 2
    assert run["output_tokens_per_s"] == pytest.approx(2.0)
    assert run["client_procs"] == 2 and run["client_cpu"] == pytest.approx(0.95)
    text = format_serve_report({"url": "u", "model": "m", "workload": "w", "runs": [run]})
    assert "the client used 95% of a core (2 process(es))" in text
    run = merge_shares("rate=inf/s", [res(10.0, 12.0, 0.2)])
    text = format_serve_report({"url": "u", "model": "m", "workload": "w", "runs": [run]})
    assert "the client used" not in text


@pytest.fixture
def sse_server():
    """A real HTTP server in a thread: /v1/models and streaming /v1/completions that
    sends ``max_tokens`` one-token events."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):
            pass

        def do_GET(self):
            data = json.dumps({"data": [{"id": "fake"}]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            assert body["model"] == "fake"
            n = body["max_tokens"]
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            self.wfile.write(sse_body(["t"] * n, {"completion_tokens": n}).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_client_processes_run_the_whole_workload(sse_server):
    wl = random_workload(9, (4, 8), (2, 6), vocab_size=50, seed=2)
    report = run_serve_bench(sse_server, wl, concurrency=[2], request_rates=[float("inf")],
                             client_procs=2, timeout_s=30)
    assert report["client_procs"] == 2 and report["model"] == "fake"
    for run in report["runs"]:
        assert run["completed"] == 9 and run["failed"] == 0 and run["client_procs"] == 2
        assert run["output_tokens"] == sum(wl.output_lens)
        assert 0 <= run["client_cpu"] < 5
    one = run_serve_bench(sse_server, wl, request_rates=[float("inf")], timeout_s=30)
    assert one["runs"][0]["client_procs"] == 1
    assert one["runs"][0]["output_tokens"] == sum(wl.output_lens)


def test_a_failing_client_process_is_named(sse_server):
    from lmkit.benchmarking.serve_procs import run_in_processes

    good = Share(prompts=[[1, 2]], output_lens=[2], offsets=None, concurrency=1)
    bad = Share(prompts=[[1, 2]], output_lens=[2, 3], offsets=None, concurrency=1)
    with pytest.raises(LMKitError, match="client process 1 failed: ValueError"):
        run_in_processes(sse_server, "fake", [good, bad], None, 30)
    with pytest.raises(ValueError, match="client_procs"):
        run_serve_bench(sse_server, random_workload(2, (4, 8), (2, 3), vocab_size=50, seed=0),
                        client_procs=0)
