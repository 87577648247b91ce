"""Online serving, side by side: ``lmkit serve`` and vLLM's OpenAI server on the same
random-weight model, loaded by the same client (:mod:`lmkit.benchmarking.serve`, the code
behind ``lmkit bench serve``) with the same seeded workload and Poisson arrivals.

Each server runs alone on the GPU, in its own process, started with the same engine
limits (max_num_seqs, max_num_batched_tokens, max_model_len); the workload is streaming
``/v1/completions`` with token-id prompts, greedy, ``ignore_eos``. Reported per server
and request rate: throughput, TTFT / TPOT / ITL (mean, p50, p99), failures; then the
ratios lmkit / vLLM.

    python bench/serve_peers.py --rates 4,16,inf --num-prompts 512 --out serve_peers.json
    python bench/serve_peers.py --sides lmkit --smoke        # CPU, toy model, lmkit only
    python bench/serve_peers.py --rates inf --client-procs 1,4  # is the client the limit?
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_models as models  # noqa: E402

LIMITS = {"max_num_seqs": 256, "max_num_batched_tokens": 16384, "max_model_len": 4096}
SIDES = ("lmkit", "vllm")


def server_command(side: str, model_dir: Path, port: int, limits: dict[str, int],
                   smoke: bool) -> list[str]:
    """The command line that starts ``side``'s OpenAI-compatible server."""
    if side == "lmkit":
        cmd = [sys.executable, "-m", "lmkit.cli.main", "serve", "--model", str(model_dir),
               "--port", str(port), "--max-num-seqs", str(limits["max_num_seqs"]),
               "--set", f"scheduler.max_num_batched_tokens={limits['max_num_batched_tokens']}",
               "--set", f"model.max_model_len={limits['max_model_len']}"]
        return cmd + (["--device", "cpu", "--dtype", "float32"] if smoke else [])
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model_dir), "--port", str(port), "--dtype", "bfloat16", "--seed", "0",
            "--max-num-seqs", str(limits["max_num_seqs"]),
            "--max-num-batched-tokens", str(limits["max_num_batched_tokens"]),
            "--max-model-len", str(limits["max_model_len"])]


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    """Seconds until ``GET url/health`` answers 200; raises if the server dies first."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server not ready after {timeout:.0f} s")


def run_side(side: str, model_dir: Path, workload: Any, rates: list[float], port: int,
             args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Start ``side``'s server, warm it up, run one sweep over ``rates``, stop it."""
    from lmkit.benchmarking.serve import run_serve_bench
    from lmkit.benchmarking.workload import random_workload

    url = f"http://127.0.0.1:{port}"
    log = (log_dir / f"{side}.log").open("wb")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.Popen(server_command(side, model_dir, port, args.limits, args.smoke),
                            stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    info: dict[str, Any] = {"side": side}
    try:
        info["ready_s"] = wait_ready(url, proc, args.ready_timeout)
        warm = random_workload(16, (64, 256), (16, 32), vocab_size=1000, seed=args.seed + 1)
        run_serve_bench(url, warm, request_rates=[float("inf")], seed=args.seed + 1)
        spy = _start_py_spy(proc.pid, args.py_spy, log_dir / f"{side}.pyspy.txt")
        for procs in args.client_procs:  # one report; runs named by their client count
            rep = run_serve_bench(url, workload, request_rates=rates, seed=args.seed,
                                  timeout_s=args.request_timeout, client_procs=procs)
            if len(args.client_procs) > 1:
                for run in rep["runs"]:
                    run["mode"] = f"{run['mode']} x{procs}"
            if "report" in info:
                info["report"]["runs"] += rep["runs"]
            else:
                info["report"] = rep
        if spy is not None:
            spy.wait(timeout=args.py_spy + 30)
            info["py_spy_top"] = summarize_py_spy(log_dir / f"{side}.pyspy.txt")
    except Exception as e:  # noqa: BLE001 - one side failing still reports the other
        info["error"] = f"{type(e).__name__}: {e}"
    finally:
        stop_server(proc)
        log.close()
    return info


def _start_py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    """Sample ``pid`` and its children with py-spy for ``seconds`` (0: off)."""
    if not seconds:
        return None
    return subprocess.Popen(["py-spy", "record", "--subprocesses", "--nonblocking", "-r", "200",
                             "-d", str(int(seconds)), "-f", "raw", "-o", str(out),
                             "--pid", str(pid)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def summarize_py_spy(path: Path, top: int = 25) -> dict[str, Any]:
    """Per sampled process (its command line, cut), the share of its busy samples and
    the ``top`` functions by self samples, from py-spy's raw (collapsed) output."""
    procs: dict[str, dict[str, int]] = {}
    if not path.exists():
        return {}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        owners = [f for f in frames if f.startswith("process ")]
        owner = owners[-1][:120] if owners else "?"
        leaf = frames[-1]
        by_leaf = procs.setdefault(owner, {})
        by_leaf[leaf] = by_leaf.get(leaf, 0) + int(count)
    return {owner: {"samples": sum(c.values()),
                    "top": sorted(c.items(), key=lambda kv: -kv[1])[:top]}
            for owner, c in procs.items()}


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers; gone already is fine."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def format_table(sides: dict[str, dict[str, Any]]) -> str:
    """One line per request rate: each side's throughput and latency percentiles."""
    lines = [f"{'rate':>14} {'side':>6} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} "
             f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
             f"{'failed':>6} {'client CPU':>10}"]
    runs: dict[str, dict[str, Any]] = {}
    for side, info in sides.items():
        if "error" in info:
            lines.append(f"{side}: ERROR {info['error']}")
            continue
        for run in info["report"]["runs"]:
            runs.setdefault(str(run["mode"]), {})[side] = run
    for rate, by_side in runs.items():
        for side, r in by_side.items():
            def ms(key: str, q: str, r: dict[str, Any] = r) -> str:
                v = (r.get(key) or {}).get(q)
                return f"{v:.1f}" if isinstance(v, (int, float)) else "-"
            lines.append(f"{rate:>14} {side:>6} {r['requests_per_s']:7.2f} "
                         f"{r['output_tokens_per_s']:10.0f} {ms('ttft_ms', 'p50'):>9} "
                         f"{ms('ttft_ms', 'p99'):>9} {ms('tpot_ms', 'p50'):>9} "
                         f"{ms('tpot_ms', 'p99'):>9} {ms('itl_ms', 'p50'):>8} "
                         f"{ms('itl_ms', 'p99'):>8} {r['failed']:>6} "
                         f"{r.get('client_cpu', float('nan')):>10.0%}")
        if {"lmkit", "vllm"} <= by_side.keys():
            a, b = by_side["lmkit"], by_side["vllm"]
            lines.append(f"{rate:>14} {'ratio':>6} {'':7} "
                         f"{a['output_tokens_per_s'] / b['output_tokens_per_s']:10.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sides", default="lmkit,vllm")
    ap.add_argument("--model", default="qwen3-0.6b", choices=models.MODELS)
    ap.add_argument("--rates", default="4,16,inf", help="requests/s, comma-separated")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", default="64:1024")
    ap.add_argument("--output-len", default="32:512")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--client-procs", default="1",
                    help="benchmark client processes per run, comma-separated for a sweep "
                         "against the same server start (one Python process reads about "
                         "10k streamed tokens/s)")
    ap.add_argument("--py-spy", type=float, default=0,
                    help="sample the server's processes with py-spy for this many seconds "
                         "from the start of the timed sweep (a host-side profile)")
    ap.add_argument("--model-root", type=Path, help="write (or reuse) the model here")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--log-dir", type=Path, help="keep the servers' logs and py-spy profiles "
                    "(raw, collapsed stacks) here instead of a temporary directory")
    args = ap.parse_args(argv)
    from lmkit.benchmarking.workload import parse_length_range, random_workload

    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if unknown := sorted(set(sides) - set(SIDES)):
        ap.error(f"unknown side {', '.join(unknown)}; known: {', '.join(SIDES)}")
    rates = [float(r) for r in args.rates.split(",")]
    args.client_procs = [int(c) for c in args.client_procs.split(",")]
    if min(args.client_procs) < 1:
        ap.error("--client-procs values must be >= 1")
    args.limits = dict(LIMITS)
    model_name = "tiny-qwen3" if args.smoke else args.model
    if args.smoke:
        args.limits.update(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
        args.num_prompts = min(args.num_prompts, 16)
        args.input_len, args.output_len = "8:64", "4:16"
    workload = random_workload(args.num_prompts, parse_length_range(args.input_len),
                               parse_length_range(args.output_len), seed=args.seed,
                               vocab_size=1000 if args.smoke else 10000)
    root = args.log_dir or Path(tempfile.mkdtemp(prefix="lmkit-serve-peers-"))
    root.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"bench": "serve_peers", "model": model_name,
                              "workload": workload.describe(), "rates": rates,
                              "limits": args.limits, "sides": {}}
    try:
        model_dir = models.write_model(model_name, (args.model_root or root) / model_name)
        for side in sides:
            print(f"=== {side}", flush=True)
            report["sides"][side] = run_side(side, model_dir, workload, rates, args.port,
                                             args, root)
            if args.out:
                args.out.write_text(json.dumps(report, indent=1, default=str))
    finally:
        for side in sides:
            log = root / f"{side}.log"
            if log.exists():
                report["sides"].setdefault(side, {})["log_tail"] = \
                    log.read_text(errors="replace")[-3000:]
        if args.log_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(format_table(report["sides"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
