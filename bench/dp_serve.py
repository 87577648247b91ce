"""Data parallel serving: ``lmkit serve --dp 1`` against ``--dp 2`` (or any sizes) on the
same model, the same seeded workload and the same fixed request rates (Poisson arrivals,
:mod:`lmkit.benchmarking.serve`, the client behind ``lmkit bench serve``).

All servers run at once, each idle while another is measured, and the rounds interleave
(dp 1, dp 2, dp 1, dp 2, ...), so a shared machine's drift hits every size alike;
reported per size and rate: the median over the rounds of throughput and TTFT / TPOT
p50 and p99, their spread (min-max), failures, and how the router split the requests
(``lmkit_router_requests_total`` per engine). On CUDA each server gets its own devices
(``--gpus 0,1,2``: dp 1 takes the first, dp 2 the next two, ``--tp`` devices per engine);
on the CPU (``--smoke``, a tiny random Qwen3) the engines share the cores, so the
numbers show that the router spreads the load rather than how it scales.

    python bench/dp_serve.py --smoke --rates 4,16 --rounds 2        # CPU
    python bench/dp_serve.py --gpus 0,1,2 --rates 8,32,inf --num-prompts 512 --out dp.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_models as models  # noqa: E402
from serve_peers import LIMITS, server_command, stop_server, wait_ready  # noqa: E402


def device_slices(sizes: list[int], tp: int, gpus: list[str]) -> list[str | None]:
    """Each server's ``CUDA_VISIBLE_DEVICES``: consecutive slices of ``gpus``, ``dp * tp``
    devices each (None for all when ``gpus`` is empty: the CPU)."""
    if not gpus:
        return [None] * len(sizes)
    need = sum(sizes) * tp
    if need > len(gpus):
        raise SystemExit(f"--dp sizes {sizes} at --tp {tp} need {need} devices, "
                         f"--gpus gives {len(gpus)}")
    out, start = [], 0
    for dp in sizes:
        out.append(",".join(gpus[start:start + dp * tp]))
        start += dp * tp
    return out


def routed_counts(url: str) -> list[float]:
    """``lmkit_router_requests_total`` per engine, from ``/metrics``."""
    import httpx

    counts: dict[int, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("lmkit_router_requests_total{"):
            labels, _, value = line.rpartition(" ")
            counts[int(labels.split('engine="')[1].split('"')[0])] = float(value)
    return [counts[e] for e in sorted(counts)]


def summarize_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and min-max of each figure over the rounds of one size and rate."""
    def pick(run: dict[str, Any], key: str) -> float | None:
        if "." in key:
            outer, inner = key.split(".")
            return (run.get(outer) or {}).get(inner)
        return run.get(key)

    out: dict[str, Any] = {"failed": sum(r["failed"] for r in runs)}
    for key in ("requests_per_s", "output_tokens_per_s", "ttft_ms.p50", "ttft_ms.p99",
                "tpot_ms.p50", "tpot_ms.p99"):
        values = [v for r in runs if isinstance(v := pick(r, key), (int, float))]
        out[key] = ({"median": statistics.median(values), "min": min(values),
                     "max": max(values)} if values else None)
    return out


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """One line per rate and size: medians with the spread of throughput."""
    lines = [f"{'rate':>6} {'dp':>3} {'req/s':>7} {'out tok/s (min-max)':>24} "
             f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'failed':>6}"]
    for rate, by_dp in results.items():
        for dp, s in by_dp.items():
            def med(key: str, s: dict[str, Any] = s) -> str:
                return f"{s[key]['median']:.1f}" if s[key] else "-"
            tput = s["output_tokens_per_s"]
            spread = f"{tput['median']:.0f} ({tput['min']:.0f}-{tput['max']:.0f})" if tput else "-"
            lines.append(f"{rate:>6} {dp:>3} {med('requests_per_s'):>7} {spread:>24} "
                         f"{med('ttft_ms.p50'):>9} {med('ttft_ms.p99'):>9} "
                         f"{med('tpot_ms.p50'):>9} {med('tpot_ms.p99'):>9} {s['failed']:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", default="1,2", help="data-parallel sizes, comma-separated")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--gpus", default="", help="CUDA devices to split over the servers")
    ap.add_argument("--model", default="qwen3-0.6b", choices=models.MODELS)
    ap.add_argument("--rates", default="4,16", help="requests/s, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per size")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", default="64:1024")
    ap.add_argument("--output-len", default="32:512")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8775, help="first port (one per size)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from lmkit.benchmarking.serve import run_serve_bench
    from lmkit.benchmarking.workload import parse_length_range, random_workload

    sizes = [int(d) for d in args.dp.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    limits = dict(LIMITS)
    model_name = "tiny-qwen3" if args.smoke else args.model
    if args.smoke:
        limits.update(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
        args.input_len, args.output_len = "8:64", "16:48"
    workload = random_workload(args.num_prompts, parse_length_range(args.input_len),
                               parse_length_range(args.output_len), seed=args.seed,
                               vocab_size=1000 if args.smoke else 10000)
    root = Path(tempfile.mkdtemp(prefix="lmkit-dp-serve-"))
    report: dict[str, Any] = {"bench": "dp_serve", "model": model_name, "tp": args.tp,
                              "workload": workload.describe(), "rates": rates,
                              "rounds": args.rounds, "limits": limits, "runs": []}
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    try:
        model_dir = models.write_model(model_name, root / model_name)
        for i, (dp, visible) in enumerate(zip(sizes, device_slices(sizes, args.tp, gpus), strict=True)):
            port = args.port + i
            env = dict(os.environ)
            if visible is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible
            cmd = server_command("lmkit", model_dir, port, limits, args.smoke)
            cmd += ["--dp", str(dp), "--tp", str(args.tp)]
            log = (root / f"dp{dp}.log").open("wb")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc, args.ready_timeout)
            warm = random_workload(8, (8, 64), (4, 8), vocab_size=1000, seed=args.seed + 1)
            run_serve_bench(url, warm, request_rates=[float("inf")], seed=args.seed + 1)
        for rnd in range(args.rounds):
            for dp, url in zip(sizes, urls, strict=True):
                before = routed_counts(url)
                rep = run_serve_bench(url, workload, request_rates=rates, seed=args.seed,
                                      timeout_s=args.request_timeout)
                after = routed_counts(url)
                routed = [a - b for a, b in zip(after, before, strict=True)]
                for run in rep["runs"]:
                    report["runs"].append({"round": rnd, "dp": dp, "routed": routed, **run})
                print(f"round {rnd} dp {dp}: routed per engine {routed}", flush=True)
                if args.out:
                    args.out.write_text(json.dumps(report, indent=1, default=str))
    finally:
        for proc in procs:
            stop_server(proc)
        for dp in sizes:
            log = root / f"dp{dp}.log"
            if log.exists():
                report.setdefault("log_tails", {})[str(dp)] = log.read_text(
                    errors="replace")[-2000:]
        shutil.rmtree(root, ignore_errors=True)
    results: dict[str, dict[str, Any]] = {}
    for run in report["runs"]:
        results.setdefault(str(run["mode"]), {}).setdefault(run["dp"], []).append(run)
    summary = {rate: {dp: summarize_rounds(runs) for dp, runs in by_dp.items()}
               for rate, by_dp in results.items()}
    report["summary"] = summary
    print(format_table(summary), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
