"""Engine steps under arrivals: what a mixed prefill+decode step costs beside a decode step.

Serving keeps ``--running`` requests decoding and adds one new request (a prompt of
``--prompt-len`` tokens) every ``--every`` steps, so the step after each arrival is a
mixed step (the newcomer's prefill and everyone's decode), the others pure decode.
Every step is timed with the device synchronized before and after; per step kind the
report gives the median and p90 time, and, on CUDA, the caching allocator's counters
over those steps (device mallocs/frees and allocation retries: a retry frees cached
blocks and synchronizes, costing milliseconds), plus the Triton kernels compiled during
the timed steps. ``--profile N`` then runs N more arrivals under the torch profiler and
prints the mixed steps' top host ops (self CPU time) and device kernels::

    python bench/mixed_steps.py --model bench:qwen3-0.6b --running 64 --arrivals 40 \\
        --profile 4 --out mixed_steps.json
    python bench/mixed_steps.py --smoke        # tiny model, CPU: checks the plumbing
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ALLOC_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def _model_dir(name: str, workdir: Path) -> Path:
    """``bench:NAME`` -> a random model of that shape written under ``workdir``."""
    if not name.startswith("bench:"):
        return Path(name)
    import gpu_bench_models

    return gpu_bench_models.write_model(name[len("bench:"):], workdir / name[len("bench:"):])


def _alloc_counters(torch: Any) -> dict[str, int]:
    if not torch.cuda.is_available():
        return dict.fromkeys(ALLOC_KEYS, 0)
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOC_KEYS}


class _Timer:
    """Steps the engine with the device synchronized around each step."""

    def __init__(self, engine: Any, torch: Any) -> None:
        self.engine, self.torch = engine, torch
        self.cuda = torch.cuda.is_available()
        self.by_kind: dict[str, list[float]] = {"mixed": [], "decode": []}
        self.alloc: dict[str, dict[str, int]] = {k: dict.fromkeys(ALLOC_KEYS, 0)
                                                 for k in self.by_kind}

    def step(self, kind: str, record: bool = True) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
        before = _alloc_counters(self.torch)
        t0 = time.perf_counter()
        self.engine.step()
        if self.cuda:
            self.torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if record:
            self.by_kind[kind].append(1e3 * dt)
            after = _alloc_counters(self.torch)
            for k in ALLOC_KEYS:
                self.alloc[kind][k] += after[k] - before[k]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the engine, keep ``running`` requests decoding, time arrivals; the report."""
    import numpy as np
    import torch
    from gpu_bench_sides import _StepRecorder
    from gpu_run_watch import watch_jit_compiles
    from lmkit.api.request import Request
    from lmkit.api.sampling_params import SamplingParams
    from lmkit.engine.core import EngineCore
    from lmkit.frontend.llm import build_config

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="lmkit-mixed-steps-"))
    model_dir = _model_dir(args.model, workdir)
    options = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_batched,
               "max_model_len": args.max_model_len, "attention": args.attention}
    if args.device != "auto":
        options["device"] = args.device
    engine = EngineCore(build_config(str(model_dir), None, options), progress=False)
    rng = np.random.default_rng(0)
    vocab = args.vocab
    total_steps = (args.arrivals + args.profile + 2) * args.every + 64
    long_run = SamplingParams(temperature=0.0, max_tokens=total_steps, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return rng.integers(1, vocab, size=n).tolist()

    for i in range(args.running):
        engine.add_request(Request(f"run-{i}", prompt(args.running_prompt_len), long_run))
    recorder = _StepRecorder(engine)  # keeps each step's scheduler output
    while engine.has_unfinished_requests():  # the running requests' prefill
        recorder.step()
        so = recorder.steps[-1][1]
        if not so.scheduled_new_reqs and all(n == 1 for n in so.num_scheduled_tokens.values()):
            break
    timer = _Timer(engine, torch)
    newcomer = SamplingParams(temperature=0.0, max_tokens=args.every, ignore_eos=True)
    # warm-up arrivals (first prefill shapes compile kernels), then the timed ones
    for i in range(3):
        engine.add_request(Request(f"warm-{i}", prompt(args.prompt_len), newcomer))
        for s in range(args.every):
            timer.step("mixed" if s == 0 else "decode", record=False)
    compiles = watch_jit_compiles()
    for i in range(args.arrivals):
        engine.add_request(Request(f"new-{i}", prompt(args.prompt_len), newcomer))
        for s in range(args.every):
            timer.step("mixed" if s == 0 else "decode")
    report: dict[str, Any] = {
        "model": args.model, "stack": {k: v for k, v in engine.stack.names().items() if v},
        "running": args.running, "prompt_len": args.prompt_len, "every": args.every,
        "arrivals": args.arrivals, "jit_compiles_during_timed_steps": list(compiles),
        "piecewise_replays": _piecewise_replays(engine), "kinds": {}}
    for kind, times in timer.by_kind.items():
        if times:
            q = sorted(times)
            report["kinds"][kind] = {
                "steps": len(q), "p50_ms": statistics.median(q),
                "p90_ms": q[min(len(q) - 1, int(0.9 * len(q)))],
                "allocator": {k: v for k, v in timer.alloc[kind].items()}}
    if args.profile:
        report["profile"] = _profile(engine, timer, args, prompt, newcomer)
    return report


def _piecewise_replays(engine: Any) -> int | None:
    """Steps the engine ran through piecewise CUDA graphs (``None``: none captured, or
    the runner lives in another process)."""
    pieces = getattr(getattr(engine.executor, "runner", None), "piecewise", None)
    return pieces.num_replays if pieces is not None else None


def _profile(engine: Any, timer: _Timer, args: argparse.Namespace, prompt: Any,
             newcomer: Any) -> dict[str, Any]:
    """``args.profile`` arrivals under the torch profiler: the mixed steps' top host ops
    and device kernels (per mixed step)."""
    import torch
    from lmkit.api.request import Request
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for i in range(args.profile):
            engine.add_request(Request(f"prof-{i}", prompt(args.prompt_len), newcomer))
            with torch.profiler.record_function("mixed_step"):
                timer.step("mixed", record=False)
            for _ in range(args.every - 1):
                timer.step("decode", record=False)
    events = prof.key_averages()
    n = max(1, args.profile)

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or 0.0)

    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    kernels = sorted((e for e in events if device_us(e) > 0), key=device_us, reverse=True)[:15]
    return {"host_top": [{"name": e.key[:100], "calls": e.count, "self_cpu_us_total":
                          e.self_cpu_time_total} for e in host],
            "kernels_top": [{"name": e.key[:100], "calls": e.count,
                             "us_per_arrival": device_us(e) / n} for e in kernels]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench:qwen3-0.6b",
                    help="a model directory or bench:NAME (bench/gpu_bench_models.py)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--running", type=int, default=64, help="requests kept decoding")
    ap.add_argument("--running-prompt-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512, help="each newcomer's prompt")
    ap.add_argument("--every", type=int, default=4, help="steps between arrivals")
    ap.add_argument("--arrivals", type=int, default=40)
    ap.add_argument("--profile", type=int, default=0, help="then profile this many arrivals")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=10000, help="prompt token ids below this")
    ap.add_argument("--workdir", help="where bench:NAME models are written (reused)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.every < 1 or args.arrivals < 1 or args.running < 0:
        ap.error("--every and --arrivals must be at least 1, --running at least 0")
    if args.smoke:
        args.model, args.device = "bench:tiny-qwen3", "cpu"
        args.running, args.prompt_len, args.arrivals = 4, 24, 3
        args.max_num_seqs, args.max_batched, args.max_model_len = 16, 256, 512
        args.vocab = 200
    report = run(args)
    for kind, r in report["kinds"].items():
        print(f"{kind:7s} steps {r['steps']:4d}  p50 {r['p50_ms']:8.2f} ms  "
              f"p90 {r['p90_ms']:8.2f} ms  allocator {r['allocator']}")
    print(f"piecewise graph replays: {report['piecewise_replays']}")
    print(f"stack {report['stack']}; Triton compiles in timed steps: "
          f"{len(report['jit_compiles_during_timed_steps'])}")
    for section in ("host_top", "kernels_top"):
        for row in report.get("profile", {}).get(section, []):
            print(f"  {section:11s} {row}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
