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


async def _closed_loop(client: Any, base_url: str, model: str, workload: Workload,
                       concurrency: int, api_key: str | None) -> list[RequestResult]:
    queue = list(zip(workload.prompts, workload.output_lens, strict=True))
    results: list[RequestResult | None] = [None] * len(queue)
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(queue):
            i = next_index
            next_index += 1
            prompt, out_len = queue[i]
            results[i] = await _one_request(client, base_url, model, prompt, out_len, api_key)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None]


async def _open_loop(client: Any, base_url: str, model: str, workload: Workload, rate: float,
                     seed: int, max_concurrency: int | None, api_key: str | None
                     ) -> list[RequestResult]:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def send(prompt: list[int], out_len: int) -> RequestResult:
        if limit is None:
            return await _one_request(client, base_url, model, prompt, out_len, api_key)
        async with limit:
            return await _one_request(client, base_url, model, prompt, out_len, api_key)

    tasks = []
    for prompt, out_len in zip(workload.prompts, workload.output_lens, strict=True):
        tasks.append(asyncio.create_task(send(prompt, out_len)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def _served_model(client: Any, base_url: str, api_key: str | None) -> str:
    resp = await client.get(f"{base_url}/v1/models", headers=_headers(api_key))
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


async def _sweep(base_url: str, workload: Workload, concurrency: Sequence[int],
                 request_rates: Sequence[float], max_concurrency: int | None,
                 api_key: str | None, model: str | None, seed: int, timeout_s: float
                 ) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        model = model or await _served_model(client, base_url, api_key)
        warm = await _one_request(client, base_url, model, workload.prompts[0], 4, api_key)
        if not warm.ok:
            from lmkit.errors import LMKitError

            raise LMKitError(f"the warm-up request to {base_url} failed: {warm.error}")
        runs = []
        for c in concurrency:
            t0 = time.perf_counter()
            results = await _closed_loop(client, base_url, model, workload, c, api_key)
            runs.append(summarize(f"concurrency={c}", results, time.perf_counter() - t0))
        for rate in request_rates:
            t0 = time.perf_counter()
            results = await _open_loop(client, base_url, model, workload, rate, seed,
                                       max_concurrency, api_key)
            runs.append(summarize(f"rate={rate:g}/s", results, time.perf_counter() - t0))
    return {"bench": "serve", "url": base_url, "model": model,
            "workload": workload.describe(), "runs": runs}


def run_serve_bench(base_url: str, workload: Workload, *, concurrency: Sequence[int] = (),
                    request_rates: Sequence[float] = (), max_concurrency: int | None = None,
                    api_key: str | None = None, model: str | None = None, seed: int = 0,
                    timeout_s: float = 600.0) -> dict[str, Any]:
    """Benchmark the server at ``base_url`` (e.g. ``http://127.0.0.1:8000``).

    Runs ``workload`` once per entry of ``concurrency`` (closed loop) and once per entry
    of ``request_rates`` (requests/s, Poisson arrivals seeded by ``seed``; ``inf`` sends
    all at once; ``max_concurrency`` caps requests in flight). With neither given, runs
    concurrency 1. ``model`` defaults to the server's. Returns the report dict (one
    entry per run in ``runs``); see :func:`format_serve_report`.
    """
    if not concurrency and not request_rates:
        concurrency = (1,)
    if any(c < 1 for c in concurrency) or any(r <= 0 for r in request_rates):
        raise ValueError("concurrency must be >= 1 and request rates > 0")
    return asyncio.run(_sweep(base_url.rstrip("/"), workload, concurrency, request_rates,
                              max_concurrency, api_key, model, seed, timeout_s))


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
    return "\n".join(lines)
