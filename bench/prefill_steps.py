"""Where a W1 prefill step's time goes: step times over three passes of W1's prompts
(each request prefilled and sampled once), the third under the torch profiler.

If the first pass is much slower than the second, the time is one-off work (Triton
compilation, cuBLAS heuristics, allocator growth) that the engine's warm-up does not
cover; if both are slow, the kernel table of the third pass says which kernels.

    python bench/prefill_steps.py --out prefill_steps.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_models as models  # noqa: E402
from gpu_args import ENGINE_OPTIONS  # noqa: E402
from gpu_workloads import SMALL, make_workloads  # noqa: E402


def run_pass(engine: Any, prompts: list[list[int]], tag: str) -> list[dict[str, Any]]:
    """Submit every prompt with max_tokens=1; time each engine step."""
    import torch
    from lmkit.api.request import Request
    from lmkit.api.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"{tag}-{i}", list(p), params))
    steps = []
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        steps.append({"ms": 1e3 * (time.perf_counter() - t)})
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--model-root", type=Path, default=Path("/tmp/lmkit-bench"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from lmkit.engine.core import EngineCore
    from lmkit.frontend.llm import build_config
    from torch.profiler import ProfilerActivity, profile

    model_dir = models.write_model(SMALL, args.model_root / SMALL)
    engine = EngineCore(build_config(str(model_dir), None,
                                     dict(ENGINE_OPTIONS, attention=args.attention)),
                        progress=False)
    prompts = make_workloads(False)["W1"]["prompts"]
    report: dict[str, Any] = {"stack": {k: v for k, v in engine.stack.names().items() if v}}
    for n, shift in enumerate((11, 23)):  # shifted ids: no prefix-cache hits between passes
        shifted = [[(t + shift) % 10000 for t in p] for p in prompts]
        steps = run_pass(engine, shifted, f"p{n}")
        report[f"pass{n + 1}_ms"] = [round(s["ms"], 1) for s in steps]
        print(f"pass {n + 1}: {len(steps)} steps, {sum(s['ms'] for s in steps):.0f} ms:",
              report[f"pass{n + 1}_ms"], flush=True)
    shifted = [[(t + 37) % 10000 for t in p] for p in prompts]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = run_pass(engine, shifted, "p3")
    report["pass3_ms"] = [round(s["ms"], 1) for s in steps]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(f"pass 3 (profiled): {sum(s['ms'] for s in steps):.0f} ms\n{table}", flush=True)
    report["kernels"] = table
    engine.shutdown()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
