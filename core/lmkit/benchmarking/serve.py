"""``lmkit bench serve``: load a running OpenAI-compatible server and measure it.

Each request is a streaming ``/v1/completions`` call with a token-id prompt from a
seeded :class:`~lmkit.benchmarking.workload.Workload`, ``ignore_eos`` and ``max_tokens`` set to
its output length, and greedy sampling, so every run of a workload asks for the same
work. A sweep runs the workload once per fixed concurrency (closed loop: N clients,
each sending its next request when the last one ends) and once per request rate (open
loop: Poisson arrivals with a seeded generator). Reported per run: requests completed
and failed, request and token throughput, and mean / p50 / p99 of time to first token
(TTFT), time per output token after the first (TPOT), inter-token latency between
streamed chunks (ITL) and end-to-end latency. A chunk counts when it carries a choice,
whether or not its text is empty (tokens of a random-weight model often decode to no
text), as vLLM's benchmark client counts them.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lmkit.benchmarking.workload import Workload

# a client process busier than this (CPU time over run time) may be what a run measures
CLIENT_SATURATED = 0.9


@dataclass
class RequestResult:
    """What one benchmark request measured (times in seconds from its own start)."""

    ok: bool
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _one_request(client: Any, base_url: str, model: str, prompt: list[int],
                       output_len: int, api_key: str | None) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    last = None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body,
                                 headers=_headers(api_key)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message"))
                    return result
                now = time.perf_counter() - start
                # every chunk with a choice carries tokens, text or not (a random-weight
                # model's tokens often decode to nothing; vLLM's client counts them too)
                if event.get("choices"):
                    if result.ttft is None:
                        result.ttft = now
                    elif last is not None:
                        result.itls.append(now - last)
                    last = now
                if event.get("usage"):
                    result.output_tokens = int(event["usage"]["completion_tokens"])
    except Exception as e:  # a failed request is counted, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = result.error is None
    return result


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {"mean": None, "p50": None, "p99": None}
    arr = np.asarray(values, dtype=np.float64) * 1000.0  # milliseconds
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p99": float(np.percentile(arr, 99))}


def summarize(mode: str, results: list[RequestResult], elapsed_s: float) -> dict[str, Any]:
    """One run's report: counts, throughput, and latency statistics in milliseconds."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "unknown")[:80]
            errors[key] = errors.get(key, 0) + 1
    return {
        "mode": mode, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": errors, "elapsed_s": elapsed_s,
        "requests_per_s": len(ok) / elapsed_s if elapsed_s else 0.0,
        "output_tokens_per_s": out_tokens / elapsed_s if elapsed_s else 0.0,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / elapsed_s if elapsed_s else 0.0,
        "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itls]),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }


@dataclass
class Share:
    """One client process's part of a run: its requests (``prompts``/``output_lens``),
    their arrival offsets in seconds from the run's start (open loop; None: closed
    loop) and how many requests it keeps in flight (closed loop: its clients; open
    loop: its part of ``max_concurrency``, None for no cap)."""

    prompts: list[list[int]]
    output_lens: list[int]
    offsets: list[float] | None
    concurrency: int | None


@dataclass
class ShareResult:
    """What one client process measured: its requests' results (in its share's order),
    the run's start and end on the host's monotonic clock, and the CPU time the
    process used in between."""

    results: list[RequestResult]
    start: float
    end: float
    cpu_s: float


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds from the start) of ``n`` requests at ``rate``
    requests/s, from a generator seeded by ``seed``; all zero for an infinite rate."""
    if not math.isfinite(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def split_run(workload: Workload, procs: int, *, concurrency: int | None = None,
              rate: float | None = None, seed: int = 0, max_concurrency: int | None = None
              ) -> list[Share]:
    """Deal one run's requests round-robin to ``procs`` client processes.

    Closed loop (``concurrency``): the clients are dealt out too, and a process with
    none is dropped, so at most ``concurrency`` processes run. Open loop (``rate``):
    every request keeps the arrival time it has in the one-process schedule, and
    ``max_concurrency`` is dealt out like the clients.
    """
    if (concurrency is None) == (rate is None):
        raise ValueError("split_run needs exactly one of concurrency and rate")
    procs = max(1, min(procs, len(workload.prompts)))
    total = concurrency if concurrency is not None else max_concurrency
    if total is not None:
        procs = min(procs, total)
    offsets = None if rate is None else arrival_offsets(len(workload.prompts), rate, seed)
    shares = []
    for i in range(procs):
        cap = None if total is None else total // procs + (i < total % procs)
        shares.append(Share(prompts=workload.prompts[i::procs],
                            output_lens=workload.output_lens[i::procs],
                            offsets=None if offsets is None else offsets[i::procs],
                            concurrency=cap))
    return shares


async def run_share(client: Any, base_url: str, model: str, share: Share,
                    api_key: str | None, start: float | None = None) -> ShareResult:
    """Send ``share``'s requests from this process: closed loop when it has no offsets
    (``share.concurrency`` clients, each sending its next request when the last ends),
    else each at ``start + offset`` (``start``: now, on ``time.monotonic``) with at most
    ``share.concurrency`` in flight."""
    start = time.monotonic() if start is None else start
    cpu0 = time.process_time()
    items = list(zip(share.prompts, share.output_lens, strict=True))
    results: list[RequestResult | None] = [None] * len(items)

    async def one(i: int) -> None:
        results[i] = await _one_request(client, base_url, model, *items[i], api_key)

    if share.offsets is None:
        next_index = 0

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(items):
                next_index += 1
                await one(next_index - 1)

        await asyncio.gather(*(worker() for _ in range(share.concurrency or 1)))
    else:
        limit = asyncio.Semaphore(share.concurrency) if share.concurrency else None

        async def send(i: int, at: float) -> None:
            if (delay := start + at - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            if limit is None:
                return await one(i)
            async with limit:
                await one(i)

        await asyncio.gather(*(send(i, at) for i, at in enumerate(share.offsets)))
    return ShareResult([r for r in results if r is not None], start, time.monotonic(),
                       time.process_time() - cpu0)


def merge_shares(mode: str, shares: Sequence[ShareResult]) -> dict[str, Any]:
    """One run's report from its client processes' results: :func:`summarize` over all
    their requests, from the earliest start to the latest end, plus ``client_procs`` and
    ``client_cpu`` (the busiest client process's CPU time over its run time: near 1.0,
    that client was saturated and the run may measure the client, not the server)."""
    start = min(s.start for s in shares)
    elapsed = max(s.end for s in shares) - start
    run = summarize(mode, [r for s in shares for r in s.results], elapsed)
    run["client_procs"] = len(shares)
    run["client_cpu"] = max(s.cpu_s / max(s.end - s.start, 1e-9) for s in shares)
    return run


async def _served_model(client: Any, base_url: str, api_key: str | None) -> str:
    resp = await client.get(f"{base_url}/v1/models", headers=_headers(api_key))
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def http_client(timeout_s: float) -> Any:
    """An ``httpx.AsyncClient`` with no cap on connections (one per request in flight)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=timeout_s, limits=limits)


async def _prepare(base_url: str, workload: Workload, api_key: str | None,
                   model: str | None, timeout_s: float) -> str:
    """The model name to ask for, after one short warm-up request that must succeed."""
    async with http_client(timeout_s) as client:
        model = model or await _served_model(client, base_url, api_key)
        warm = await _one_request(client, base_url, model, workload.prompts[0], 4, api_key)
    if not warm.ok:
        from lmkit.errors import LMKitError

        raise LMKitError(f"the warm-up request to {base_url} failed: {warm.error}")
    return model


async def _run_here(base_url: str, model: str, share: Share, api_key: str | None,
                    timeout_s: float) -> ShareResult:
    async with http_client(timeout_s) as client:
        return await run_share(client, base_url, model, share, api_key)


def run_serve_bench(base_url: str, workload: Workload, *, concurrency: Sequence[int] = (),
                    request_rates: Sequence[float] = (), max_concurrency: int | None = None,
                    api_key: str | None = None, model: str | None = None, seed: int = 0,
                    timeout_s: float = 600.0, client_procs: int = 1) -> dict[str, Any]:
    """Benchmark the server at ``base_url`` (e.g. ``http://127.0.0.1:8000``).

    Runs ``workload`` once per entry of ``concurrency`` (closed loop) and once per entry
    of ``request_rates`` (requests/s, Poisson arrivals seeded by ``seed``; ``inf`` sends
    all at once; ``max_concurrency`` caps requests in flight). With neither given, runs
    concurrency 1. ``model`` defaults to the server's. ``client_procs`` > 1 sends each
    run from that many processes (:func:`split_run`,
    :mod:`lmkit.benchmarking.serve_procs`), for servers that stream faster than one
    Python process can read; every run reports ``client_cpu`` (see
    :func:`merge_shares`). Returns the report dict (one entry per run in ``runs``); see
    :func:`format_serve_report`.
    """
    if not concurrency and not request_rates:
        concurrency = (1,)
    if any(c < 1 for c in concurrency) or any(r <= 0 for r in request_rates):
        raise ValueError("concurrency must be >= 1 and request rates > 0")
    if client_procs < 1:
        raise ValueError(f"client_procs must be >= 1, got {client_procs}")
    base_url = base_url.rstrip("/")
    model = asyncio.run(_prepare(base_url, workload, api_key, model, timeout_s))
    runs = [(f"concurrency={c}", split_run(workload, client_procs, concurrency=c))
            for c in concurrency]
    runs += [(f"rate={r:g}/s", split_run(workload, client_procs, rate=r, seed=seed,
                                         max_concurrency=max_concurrency))
             for r in request_rates]
    reports = []
    for mode, shares in runs:
        if len(shares) == 1:
            done = [asyncio.run(_run_here(base_url, model, shares[0], api_key, timeout_s))]
        else:
            from lmkit.benchmarking.serve_procs import run_in_processes

            done = run_in_processes(base_url, model, shares, api_key, timeout_s)
        reports.append(merge_shares(mode, done))
    return {"bench": "serve", "url": base_url, "model": model,
            "workload": workload.describe(), "client_procs": client_procs, "runs": reports}


def format_serve_report(report: dict[str, Any]) -> str:
    """The report as a fixed-width table (milliseconds for latencies)."""
    lines = [f"lmkit bench serve: {report['url']} model={report['model']}",
             f"workload: {report['workload']}", ""]
    head = (f"{'run':<18}{'ok':>5}{'fail':>5}{'req/s':>8}{'out tok/s':>11}"
            f"{'TTFT mean/p50/p99':>22}{'TPOT mean/p50/p99':>22}{'ITL mean/p50/p99':>22}")
    lines.append(head)
    lines.append("-" * len(head))

    def trio(s: dict[str, float | None]) -> str:
        if s["mean"] is None:
            return "-"
        return f"{s['mean']:.0f}/{s['p50']:.0f}/{s['p99']:.0f}"

    for run in report["runs"]:
        lines.append(f"{run['mode']:<18}{run['completed']:>5}{run['failed']:>5}"
                     f"{run['requests_per_s']:>8.2f}{run['output_tokens_per_s']:>11.1f}"
                     f"{trio(run['ttft_ms']):>22}{trio(run['tpot_ms']):>22}"
                     f"{trio(run['itl_ms']):>22}")
        for err, count in run["errors"].items():
            lines.append(f"    {count} x {err}")
        cpu = run.get("client_cpu")
        if cpu is not None and cpu >= CLIENT_SATURATED:
            lines.append(f"    the client used {cpu:.0%} of a core ({run['client_procs']} "
                         "process(es)): this run may measure the client, not the server; "
                         "add client processes (--client-procs)")
    return "\n".join(lines)
