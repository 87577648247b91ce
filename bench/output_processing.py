"""The frontend's per-step output processing (``lmkit.frontend.output_processor``) of a
git revision against the working tree's, on the CPU, in one process: ``--batch``
requests each get one token per step for ``--steps`` steps (the last finishes them),
through a byte tokenizer. The revision's side runs its defaults; the working tree's asks
for ``--kind`` outputs (``final``, as ``LLM.generate`` and the server's non-streamed
requests; ``--streaming``: ``delta``, as the server's streams; ``cumulative``: as
``AsyncLLM.generate``'s default). Rounds alternate the sides; medians of microseconds
per step::

    python bench/output_processing.py --rev HEAD~1 --batch 32 --steps 512 --rounds 7

(The host work it measures sits between engine steps: on a GPU whose step is shorter
than the host's, it sets the step rate.)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from before_after import before_after  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODULE = "core/lmkit/frontend/output_processor.py"


def old_processor(rev: str) -> type:
    """``OutputProcessor`` as of revision ``rev`` (its module's source, run apart)."""
    text = subprocess.run(["git", "show", f"{rev}:{MODULE}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    module = types.ModuleType("output_processor_before")
    sys.modules[module.__name__] = module  # (dataclasses look their module up)
    exec(compile(text, f"{rev}:{MODULE}", "exec"), module.__dict__)
    return module.OutputProcessor


def run_side(cls: type, kind: str | None, batch: int, steps: int) -> float:
    """Seconds per step of ``cls`` over one run (``kind=None``: the class's default)."""
    from lmkit.api.outputs import EngineCoreOutput
    from lmkit.api.request import Request
    from lmkit.api.sampling_params import SamplingParams
    from lmkit.testing.tiny_model import make_byte_tokenizer

    tok = make_byte_tokenizer()
    proc = cls(tok)
    params = SamplingParams(max_tokens=steps)
    kw = {} if kind is None else {"kind": kind}
    for i in range(batch):
        proc.add_request(Request(str(i), [1, 2, 3], params), None, **kw)
    token = tok.encode("a", add_special_tokens=False)
    start = time.perf_counter()
    for s in range(steps):
        reason = "length" if s == steps - 1 else None
        proc.process_outputs([EngineCoreOutput(str(i), token, finish_reason=reason)
                              for i in range(batch)])
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD", help="the 'before' git revision")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kind", choices=["cumulative", "delta", "final"], default="final",
                    help="the working tree's output kind")
    ap.add_argument("--streaming", action="store_true", help="the same as --kind delta")
    args = ap.parse_args()
    from lmkit.frontend.output_processor import OutputProcessor

    sides = {"before": (old_processor(args.rev), None),
             "after": (OutputProcessor, "delta" if args.streaming else args.kind)}
    for batch in args.batch:
        before_after(f"batch {batch:4d}, {args.steps} steps",
                     lambda name, batch=batch: run_side(*sides[name], batch, args.steps),
                     args.rounds)

if __name__ == "__main__":
    main()
