"""Where the host's time goes in an engine's decode steps: ``cProfile`` over the steps.

A step the GPU finishes before the host has queued the next one leaves the GPU idle;
``bench/gpu_engine.py --profile-run`` shows how long (its idle share and gaps), this
shows which Python functions the host spent that time in. It starts one engine core
on a random-weight model of ``bench/gpu_bench_models.py``, submits ``--requests``
requests of ``--prompt-len`` prompt tokens (each its own ids) with ``--sampling``,
runs until every request decodes, then profiles ``--steps`` engine steps and prints
the functions by own time and by cumulative time, and the steps' wall time::

    python bench/host_profile.py --model qwen3-0.6b --requests 256 --steps 200 \\
        --sampling '{"temperature": 0.7, "top_p": 0.95}' --attention triton
    python bench/host_profile.py --model tiny-qwen3 --requests 8 --steps 20   # CPU smoke

(cProfile slows Python about 1.5-2x; read the shares, not the absolute times.)
``--sync-steps N`` then runs N more steps with torch's CUDA sync debug mode and lists
the places where the host waited for the device, e.g. an indexing assignment of a
Python number (:func:`lmkit.sample.row_cache.put_scalar`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_models as models  # noqa: E402
from gpu_args import ENGINE_OPTIONS  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--model-root", type=Path, help="where models are written (default: a "
                    "temporary folder)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sampling", type=json.loads, default={},
                    help='sampling parameters as JSON (default greedy), e.g. '
                         '\'{"temperature": 0.7, "top_p": 0.95}\'')
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--top", type=int, default=30, help="functions listed per table")
    ap.add_argument("--sync-steps", type=int, default=0,
                    help="then run this many steps with torch's CUDA sync debug mode on and "
                         "list where the host waited for the device (CUDA only)")
    ap.add_argument("--out", type=Path, help="also write the report here (JSON)")
    args = ap.parse_args(argv)
    if not isinstance(args.sampling, dict):
        ap.error("--sampling takes a JSON object of sampling parameters")
    if args.requests < 1 or args.steps < 1 or args.prompt_len < 1:
        ap.error("--requests, --steps and --prompt-len must be at least 1")
    return args


def start_engine(model_dir: Path, args: argparse.Namespace) -> Any:
    import torch
    from lmkit.engine.core import EngineCore
    from lmkit.frontend.llm_options import build_config

    options: dict[str, Any] = dict(ENGINE_OPTIONS, attention=args.attention)
    if not torch.cuda.is_available():  # the CPU smoke run
        options.update(max_num_seqs=max(8, args.requests), max_num_batched_tokens=2048,
                       max_model_len=1024)
    return EngineCore(build_config(str(model_dir), None, options), progress=False)


def submit(engine: Any, args: argparse.Namespace) -> None:
    from lmkit.api.request import Request
    from lmkit.api.sampling_params import SamplingParams

    params = SamplingParams(**{"temperature": 0.0, **args.sampling}, ignore_eos=True,
                            max_tokens=args.steps + 64)
    for i in range(args.requests):
        prompt = [(7 * i + 13 * t) % 1000 + 1 for t in range(args.prompt_len)]
        engine.add_request(Request(f"host-{i}", prompt, params))


def profile_steps(engine: Any, args: argparse.Namespace
                  ) -> tuple[cProfile.Profile, list[float]]:
    """Step until every request has two tokens (its prompt is done and it decodes), then
    ``args.steps`` steps profiled."""
    tokens: dict[str, int] = {}
    while engine.has_unfinished_requests() and (
            len(tokens) < args.requests or min(tokens.values()) < 2):
        for out in engine.step():
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
    prof = cProfile.Profile()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        prof.enable()
        engine.step()
        prof.disable()
        times.append(time.perf_counter() - t0)
    return prof, times


def find_syncs(engine: Any, steps: int) -> dict[str, int]:
    """Run ``steps`` engine steps with ``torch.cuda.set_sync_debug_mode("warn")``; each
    place lmkit's code made the host wait for the device (its last lmkit frames) and
    how often."""
    import collections
    import traceback
    import warnings

    import torch

    sites: collections.Counter[str] = collections.Counter()

    def record(*_: Any, **__: Any) -> None:
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "lmkit" in f.filename and not f.filename.endswith("host_profile.py")]
        sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[::-1][:4])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return dict(sites.most_common())


def table(prof: cProfile.Profile, sort: str, top: int) -> tuple[str, list[dict[str, Any]]]:
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream).sort_stats(sort)
    stats.print_stats(top)
    rows = []
    for func, (_, calls, tottime, cumtime, _) in sorted(
            stats.stats.items(),  # type: ignore[attr-defined]
            key=lambda kv: -kv[1][2 if sort == "tottime" else 3])[:top]:
        rows.append({"function": f"{Path(func[0]).name}:{func[1]}({func[2]})", "calls": calls,
                     "tottime_s": tottime, "cumtime_s": cumtime})
    return stream.getvalue(), rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.model_root or Path(tmp)
        model_dir = models.write_model(args.model, root / args.model)
        engine = start_engine(model_dir, args)
        submit(engine, args)
        prof, times = profile_steps(engine, args)
        syncs = None
        if args.sync_steps:
            import torch

            syncs = (find_syncs(engine, args.sync_steps) if torch.cuda.is_available()
                     else {"(no CUDA: nothing to find)": 0})
        engine.abort_requests([f"host-{i}" for i in range(args.requests)])
    step_ms = 1e3 * sum(times) / len(times)
    print(f"{args.model}, {args.requests} requests, {args.steps} steps profiled, sampling "
          f"{args.sampling or 'greedy'}: {step_ms:.2f} ms per step under cProfile")
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                              "step_ms": step_ms}
    for sort in ("tottime", "cumulative"):
        text, rows = table(prof, sort, args.top)
        print(f"\n# by {sort}\n" + "\n".join(text.splitlines()[6:]))
        report[sort] = rows
    if syncs is not None:
        report["syncs"] = syncs
        print(f"\n# host waits for the device in {args.sync_steps} steps (sync debug mode)")
        for where, count in syncs.items():
            print(f"{count:6d}  {where}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
