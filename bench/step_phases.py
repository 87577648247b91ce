"""Host time of each engine step by kind and by the model runner's phases, with and
without a draft head: where a batch-1 step's milliseconds go on the host (the wait for
the device shows up in the phase that reads back).

Each engine is built as usual; the runner's phases are wrapped with clocks (no device
synchronisation is added): preparing the inputs, the forward, sampling (and the
read-back of its greedy tokens), committing them, the head's catch-up and chained draft
passes (``propose``), launching the next step ahead, taking a step launched ahead, and
every ``.cpu()`` / ``.tolist()`` read-back. Steps are told apart by kind: ``prefill``
(a request scheduled several tokens, no drafts: a prompt), ``decode``, ``verify``
(drafts scheduled). Requests run one at a time through the model's chat template::

    python bench/step_phases.py --model smol.gguf --speculative-model HEAD --requests 16
    python bench/step_phases.py --model TINY_DIR --device cpu --sides plain   # a smoke run

Prints one line per side and kind: the number of steps and each phase's median
milliseconds per step (``execute`` is the whole runner step). ``--out`` writes them as
JSON. Without ``--speculative-model`` only the plain side runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

#: (module or class path, attribute, phase name) wrapped with a clock
PHASES = (
    ("lmkit.worker.model_runner:ModelRunner", "_prepare_step", "prepare"),
    ("lmkit.worker.model_runner:ModelRunner", "_forward", "forward"),
    ("lmkit.worker.model_runner", "sample_step", "sample"),
    ("lmkit.worker.model_runner", "commit_tokens", "commit"),
    ("lmkit.worker.model_runner", "take_ahead", "take_ahead"),
    ("lmkit.worker.draft_runner:DraftRunner", "propose", "propose"),
    ("lmkit.worker.draft_runner:DraftRunner", "_catch_up", "catch_up"),
    ("lmkit.worker.draft_runner:DraftRunner", "_chained_drafts", "chained"),
    ("lmkit.worker.spec_lookahead:SpecLookahead", "after_step", "spec_after_step"),
    ("lmkit.worker.spec_lookahead:SpecLookahead", "_launch", "spec_launch"),
)


def step_kind(num_scheduled: list[int], has_drafts: bool) -> str:
    """``verify``, ``prefill``, ``decode`` or ``empty`` for one scheduled step."""
    if not num_scheduled:
        return "empty"
    if has_drafts:
        return "verify"
    return "prefill" if max(num_scheduled) > 1 else "decode"


def _resolve(path: str) -> Any:
    import importlib

    module, _, cls = path.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, cls) if cls else obj


@contextmanager
def clocked(records: list[dict[str, Any]]) -> Iterator[None]:
    """Wrap the runner's phases (and read-backs) with clocks while the block runs; each
    runner step appends ``{phase: seconds, ..., "kind": ...}`` to ``records``."""
    import torch
    from lmkit.worker import model_runner

    current: dict[str, float] = {}
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        # a class attribute it only inherits is deleted again afterwards, not pinned
        own = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name)
        saved.append((owner, name, own))
        setattr(owner, name, wrapper)

    def timed(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[label] = current.get(label, 0.0) + time.perf_counter() - start
        return run

    for path, name, label in PHASES:
        owner = _resolve(path)
        patch(owner, name, timed(getattr(owner, name), label))
    patch(torch.Tensor, "cpu", timed(torch.Tensor.cpu, "read_cpu"))
    patch(torch.Tensor, "tolist", timed(torch.Tensor.tolist, "read_tolist"))
    execute = model_runner.ModelRunner.execute_model

    def step(self: Any, so: Any) -> Any:
        current.clear()
        start = time.perf_counter()
        out = execute(self, so)
        rec: dict[str, Any] = dict(current)
        rec["execute"] = time.perf_counter() - start
        rec["kind"] = step_kind(list(so.num_scheduled_tokens.values()),
                                bool(so.scheduled_spec_decode_tokens))
        records.append(rec)
        return out

    patch(model_runner.ModelRunner, "execute_model", step)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per step kind: the number of steps and each phase's median milliseconds (a phase
    a step did not run counts 0 there)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({r["kind"] for r in records}):
        rows = [r for r in records if r["kind"] == kind]
        phases = sorted({k for r in rows for k in r if k != "kind"})
        out[kind] = {"steps": len(rows), "ms": {
            p: 1e3 * statistics.median(r.get(p, 0.0) for r in rows) for p in phases}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="target (GGUF file or model directory)")
    ap.add_argument("--speculative-model", help="an EAGLE-3 head: also run the eagle3 side")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--sides", nargs="+", choices=("plain", "eagle3"),
                    default=["plain", "eagle3"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="the engines' context (0: the model's own)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    sides = [s for s in args.sides if s == "plain" or args.speculative_model]
    if not sides:
        ap.error("the eagle3 side needs --speculative-model")
    from engine_ab import workload
    from lmkit import LLM, SamplingParams
    from spec_pair import pair_and_prompts

    target, head, _ = pair_and_prompts(args.model, args.speculative_model, 1)
    report: dict[str, Any] = {}
    for side in sides:
        kw: dict[str, Any] = dict(device=args.device, dtype=args.dtype, max_num_seqs=4)
        if args.max_model_len:
            kw["max_model_len"] = args.max_model_len
        if args.device == "cuda":
            kw.update(attention=args.attention, gpu_memory_utilization=0.3)
        if side == "eagle3":
            kw.update(speculative="eagle3", speculative_model=head,
                      num_speculative_tokens=args.k)
        llm = LLM(target, **kw)
        prompts = workload(llm.tokenizer, args.requests, args.output_len)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                ignore_eos=args.ignore_eos)
        llm.generate(prompts[:2], params)  # warm-up
        records: list[dict[str, Any]] = []
        with clocked(records):
            for prompt in prompts:
                llm.generate([prompt], params)
        llm.shutdown()
        report[side] = summarize(records)
        for kind, entry in report[side].items():
            phases = "  ".join(f"{p} {ms:.3f}" for p, ms in entry["ms"].items())
            print(f"{side:7s} {kind:8s} steps {entry['steps']:5d}  {phases}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
