"""Where a speculative engine's time goes at batch 1, on the GPU's side: the run under
the torch profiler (CUDA activity only: kernels, copies, and the CUDA runtime calls the
host made), one engine per side in one process:

* the GPU's busy fraction and its idle gaps by size (``bench/gpu_run_profile.py``),
* kernels per engine step, and the ``--top`` kernels by time (calls and us per step),
* the time the host spent blocked in CUDA calls that wait for the device (event and
  stream synchronisation, synchronous copies), per step.

A side is ``plain`` (no speculation) or a proposer, optionally with environment
switches set while its engine is built, e.g.::

    python bench/spec_timeline.py --model smol.gguf --speculative-model head \\
        --sides plain eagle3 eagle3:LMKIT_SPEC_DEVICE_STEP=0 --out timeline.json

runs the built-in chat prompts (EOS ignored: every request runs ``--output-len``).
Without ``--model`` it runs the random SmolLM2-shaped pair of ``bench/draft_chain.py``
(a random head: its drafts are never accepted) on random prompts. ``--batch N`` runs
the requests N at a time instead of one by one, and ``--set PATH=VALUE`` sets a
setting of every speculating engine (e.g. speculation off above a batch size)::

    python bench/spec_timeline.py --batch 32 --requests 32 --sides plain eagle3 \
        --set speculative.disable_by_batch_size=16 --set speculative.catch_up_when_off=false

Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from gpu_args import env_during, parse_env, parse_sets  # noqa: E402
from gpu_run_profile import summarize_trace  # noqa: E402
from spec_pair import chat_prompts, pair_and_prompts  # noqa: E402

#: CUDA runtime calls in which the host waits for the device
BLOCKING = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "cudaMemcpy", "cudaMemcpyAsync")


def blocked(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Host time in the :data:`BLOCKING` runtime calls (``cudaMemcpyAsync`` counts only
    its calls over 50 us: those from pageable memory, which wait)."""
    out: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "cuda_runtime":
            continue
        name = e.get("name", "")
        if name in BLOCKING and (name != "cudaMemcpyAsync" or e["dur"] > 50):
            slot = out.setdefault(name, [0.0, 0])
            slot[0] += e["dur"] / 1e6
            slot[1] += 1
    return {name: {"s": s, "calls": int(c)} for name, (s, c) in out.items()}


def parse_side(side: str) -> tuple[str, dict[str, str]]:
    """``PROPOSER[:NAME=VALUE,...]`` -> the proposer (``plain``: none) and the environment
    switches set while its engine is built."""
    proposer, _, env = side.partition(":")
    switches = parse_env(env, f"side {side!r}")
    if not proposer:
        raise SystemExit(f"side {side!r}: name a proposer (or plain)")
    return proposer, switches


def run_side(args: argparse.Namespace, side: str, model: str, head: str | None,
             prompts: list | None) -> dict[str, Any]:
    """Build the side's engine, warm it, profile ``prompts`` ``args.batch`` at a time
    (``None``: the built-in chat prompts through the model's chat template)."""
    import torch
    from lmkit import LLM, SamplingParams
    from torch.profiler import ProfilerActivity, profile

    proposer, switches = parse_side(side)
    kw: dict[str, Any] = {}
    if proposer != "plain":
        kw = dict(speculative=proposer, num_speculative_tokens=args.k, **args.settings)
        if proposer.startswith("eagle"):
            kw["speculative_model"] = head
    with env_during(switches):
        llm = LLM(model, device="cuda", attention=args.attention, dtype="bfloat16",
                  max_num_seqs=max(4, args.batch), max_model_len=2048,
                  gpu_memory_utilization=0.3, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    if prompts is None:
        prompts = chat_prompts(llm.tokenizer, args.requests, args.output_len)
    llm.generate(prompts[:args.batch], params)  # warm-up
    steps0 = llm.stats().get("num_steps", 0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(prompts), args.batch):
            outs = llm.generate(prompts[i:i + args.batch], params)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    steps = llm.stats().get("num_steps", 0) - steps0
    llm.shutdown()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    summary = summarize_trace(events, wall, top=args.top)
    for k in summary["top_kernels"]:  # per engine step, to compare sides
        k["us_per_step"] = 1e6 * k["s"] / max(1, steps)
        k["calls_per_step"] = k["calls"] / max(1, steps)
    waits = blocked(events)
    wait_s = sum(w["s"] for w in waits.values())
    return {"side": side, "wall_s": wall, "tokens": tokens, "steps": steps,
            "tok_per_s": tokens / wall, "ms_per_step": 1e3 * wall / max(1, steps),
            "kernels_per_step": summary["kernels"] / max(1, steps),
            "gpu_busy_ms_per_step": 1e3 * summary["gpu_busy_s"] / max(1, steps),
            "host_blocked_ms_per_step": 1e3 * wait_s / max(1, steps), "blocking": waits,
            **summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target (default: a random SmolLM2-shaped model)")
    ap.add_argument("--speculative-model", help="the EAGLE head (default: a random one)")
    ap.add_argument("--sides", nargs="+", default=["plain", "eagle3",
                                                   "eagle3:LMKIT_SPEC_DEVICE_STEP=0"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--batch", type=int, default=1, help="requests run at a time")
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                    help="a setting of every speculating engine (value read as JSON)")
    ap.add_argument("--top", type=int, default=12,
                    help="kernels listed per side (by total time), each also per step")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.batch < 1:
        ap.error(f"--batch must be at least 1, got {args.batch}")
    if args.top < 0:
        ap.error(f"--top must be at least 0, got {args.top}")
    args.settings = parse_sets(";".join(args.set), "--set")
    import torch

    if not torch.cuda.is_available():
        sys.exit("spec_timeline needs CUDA")
    model, head, prompts = pair_and_prompts(args.model, args.speculative_model, args.requests)
    results = []
    for side in args.sides:
        r = run_side(args, side, model, head, prompts)
        results.append(r)
        print(f"{side:40s} {r['tok_per_s']:8.1f} tok/s  {r['ms_per_step']:6.3f} ms/step  "
              f"GPU busy {r['gpu_busy_ms_per_step']:6.3f} ms/step "
              f"(idle {100 * (r['gpu_idle_frac'] or 0):4.1f}%)  "
              f"{r['kernels_per_step']:6.1f} kernels/step  host blocked "
              f"{r['host_blocked_ms_per_step']:6.3f} ms/step", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
