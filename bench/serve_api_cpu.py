"""CPU cost of ``lmkit serve``'s API process per streamed output token, A/B by source tree.

Starts one ``lmkit serve`` per source tree (``--tree NAME=DIR``: DIR's ``core``,
``plugins`` and ``kernels`` go first on the server's ``PYTHONPATH``) on the same tiny
random-weight Llama (2 layers, hidden 64) with a real BPE tokenizer (SmolLM2's, 49,152
ids, so detokenizing costs what it costs on a real model), then loads the servers in
interleaved rounds (A, B, A, B, ...) with the client of ``lmkit bench serve``: streaming
``/v1/completions``, ``ignore_eos``, a fixed concurrency. Per round: the API process's
CPU seconds (user + system, all its threads; the engine process is a child and not
counted) from ``/proc`` via psutil, divided by the output tokens streamed. Reports each
round and, per tree, the median and spread in microseconds per token.

    python bench/serve_api_cpu.py --tree base=/tmp/base --tree new=. --rounds 5
    python bench/serve_api_cpu.py --tree new=. --rounds 1 --py-spy 15   # + a profile

Take the CPU lock for timing runs on a shared machine:
``flock /tmp/cpu_bench.lock -c "python bench/serve_api_cpu.py ..."``.
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
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_peers import stop_server, summarize_py_spy, wait_ready  # noqa: E402

SMOLLM2_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                           "special_tokens_map.json")


def default_tokenizer_dir() -> Path | None:
    """The converted SmolLM2 in lmkit's cache (``pytest`` fetches it once), if present."""
    from lmkit.loading.cache import default_cache_dir

    for d in sorted((default_cache_dir() / "converted").glob("SmolLM2-135M-Instruct*")):
        if (d / "tokenizer.json").exists():
            return d
    return None


def make_model(directory: Path, tokenizer_dir: Path | None) -> tuple[Path, int]:
    """A tiny random Llama; with ``tokenizer_dir``, its vocabulary and tokenizer files
    replace the byte tokenizer. Returns the directory and the vocabulary size."""
    from lmkit.testing.tiny_model import make_tiny_model

    if tokenizer_dir is None:
        return make_tiny_model(directory, max_position_embeddings=2048), 257
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    make_tiny_model(directory, vocab_size=vocab, max_position_embeddings=2048)
    for name in SMOLLM2_TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory, vocab


def start_server(tree: Path, model_dir: Path, port: int, max_num_seqs: int,
                 log: Path, extra: list[str], extra_path: str | None = None
                 ) -> subprocess.Popen[bytes]:
    """``lmkit serve`` with ``tree``'s sources (then ``extra_path``) first on the import
    path."""
    paths = [str(tree.resolve() / p) for p in ("core", "plugins", "kernels")]
    paths += [extra_path] if extra_path else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lmkit.cli.main", "serve", "--model", str(model_dir),
           "--port", str(port), "--device", "cpu", "--dtype", "float32",
           "--max-num-seqs", str(max_num_seqs), "--log-level", "warning",
           "--set", "model.max_model_len=2048", *extra]
    with log.open("wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def api_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` itself (all threads, no children)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of process ``pid`` (threads of one name summed)."""
    import psutil

    out: dict[str, float] = {}
    for t in psutil.Process(pid).threads():
        try:
            name = Path(f"/proc/{pid}/task/{t.id}/comm").read_text().strip()
        except OSError:
            name = "?"
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out


def load_round(url: str, pid: int, workload: Any, concurrency: int) -> dict[str, float]:
    """One load round: API CPU seconds, output tokens, and microseconds per token."""
    from lmkit.benchmarking.serve import run_serve_bench

    threads0 = thread_cpu_seconds(pid)
    cpu0, t0 = api_cpu_seconds(pid), time.perf_counter()
    report = run_serve_bench(url, workload, concurrency=[concurrency])
    cpu, wall = api_cpu_seconds(pid) - cpu0, time.perf_counter() - t0
    threads = {k: round(v - threads0.get(k, 0.0), 3)
               for k, v in thread_cpu_seconds(pid).items() if v - threads0.get(k, 0.0) > 0}
    run = report["runs"][0]
    if run["failed"]:
        raise RuntimeError(f"{run['failed']} requests failed: {run['errors']}")
    tokens = run["output_tokens"]
    return {"cpu_s": cpu, "wall_s": wall, "tokens": tokens,
            "us_per_token": cpu / tokens * 1e6, "tok_per_s": run["output_tokens_per_s"],
            "itl_p50_ms": run["itl_ms"]["p50"], "itl_p99_ms": run["itl_ms"]["p99"],
            "threads_cpu_s": threads}


def profile(pid: int, seconds: float, out: Path, url: str, workload: Any,
            concurrency: int) -> dict[str, Any]:
    """py-spy on the API process only (no subprocesses) while one round runs."""
    spy = subprocess.Popen(["py-spy", "record", "--nonblocking", "-r", "200", "-d",
                            str(int(seconds)), "-f", "raw", "-o", str(out), "--pid", str(pid)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while spy.poll() is None:  # keep the server loaded for the whole profile
        load_round(url, pid, workload, concurrency)
    return {"self": summarize_py_spy(out, top=25), "inclusive": inclusive_shares(out)}


def inclusive_shares(path: Path, top: int = 40) -> list[tuple[str, float]]:
    """The ``top`` functions by inclusive share of the samples (a function counted once
    per sample however deep it recurs), from py-spy's raw output."""
    totals: dict[str, int] = {}
    num = 0
    if not path.exists():
        return []
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        num += int(count)
        for frame in set(stack.split(";")):
            totals[frame] = totals.get(frame, 0) + int(count)
    return [(f, round(n / num, 4)) for f, n in sorted(totals.items(), key=lambda kv: -kv[1])
            [:top]] if num else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, metavar="NAME=DIR",
                   help="a source tree to serve from (repeat for A/B)")
    p.add_argument("--extra-path", action="append", default=[], metavar="NAME=PATH",
                   help="also put PATH on tree NAME's import path (e.g. a --target install "
                   "of the fast-serve extra)")
    p.add_argument("--rounds", type=int, default=3, help="load rounds per tree")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--tokenizer-from", type=Path, default=None,
                   help="a model directory whose tokenizer to use (default: the cached "
                   "SmolLM2; the byte tokenizer when absent)")
    p.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                   help="after the rounds, profile each tree's API process for one round")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for every `lmkit serve`")
    p.add_argument("--port", type=int, default=18300)
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = p.parse_args(argv)

    from lmkit.benchmarking.serve import run_serve_bench
    from lmkit.benchmarking.workload import random_workload

    trees = dict(t.split("=", 1) for t in args.tree)
    extra_paths = dict(t.split("=", 1) for t in args.extra_path)
    root = Path(tempfile.mkdtemp(prefix="lmkit-api-cpu-"))
    model_dir, vocab = make_model(root / "model", args.tokenizer_from or default_tokenizer_dir())
    workload = random_workload(args.requests, (args.input_len, args.input_len),
                               (args.output_len, args.output_len), vocab_size=vocab, seed=0)
    warm = random_workload(16, (8, 32), (8, 16), vocab_size=vocab, seed=1)
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    result: dict[str, Any] = {"workload": workload.describe(), "concurrency": args.concurrency,
                              "vocab": vocab, "rounds": [], "load_before": os.getloadavg()}
    try:
        for i, (name, tree) in enumerate(trees.items()):
            port = args.port + i
            proc = start_server(Path(tree), model_dir, port, args.concurrency,
                                root / f"{name}.log", args.server_arg, extra_paths.get(name))
            servers[name] = (proc, f"http://127.0.0.1:{port}")
        for proc, url in servers.values():
            wait_ready(url, proc, 300)
            run_serve_bench(url, warm, concurrency=[8])
        for r in range(args.rounds):
            for name, (proc, url) in servers.items():
                rec = {"round": r, "tree": name, **load_round(url, proc.pid, workload,
                                                               args.concurrency)}
                result["rounds"].append(rec)
                print(json.dumps(rec), flush=True)
        if args.py_spy:
            spy_dir = args.out.parent if args.out else root
            result["py_spy"] = {name: profile(proc.pid, args.py_spy, spy_dir / f"{name}.spy",
                                              url, workload, args.concurrency)
                                for name, (proc, url) in servers.items()}
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    result["load_after"] = os.getloadavg()
    summary = {}
    for name in trees:
        us = [r["us_per_token"] for r in result["rounds"] if r["tree"] == name]
        summary[name] = {"median_us_per_token": statistics.median(us), "min": min(us),
                         "max": max(us), "rounds": len(us)}
    first = next(iter(trees))
    for name in list(trees)[1:]:  # paired: the same round's ratio to the first tree
        ratios = [b["us_per_token"] / a["us_per_token"]
                  for a in result["rounds"] if a["tree"] == first
                  for b in result["rounds"] if b["tree"] == name and b["round"] == a["round"]]
        summary[name][f"median_ratio_to_{first}"] = statistics.median(ratios)
    result["summary"] = summary
    print(json.dumps({"summary": summary, "load": [result["load_before"],
                                                   result["load_after"]]}, indent=1))
    if "py_spy" in result:
        for name, spy in result["py_spy"].items():
            print(f"== {name}: inclusive")
            for frame, share in spy["inclusive"]:
                print(f"  {share:6.1%}  {frame}")
            for owner, info in spy["self"].items():
                print(f"== {name}: {owner} ({info['samples']} samples)")
                for leaf, n in info["top"]:
                    print(f"  {n / info['samples']:6.1%}  {leaf}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
