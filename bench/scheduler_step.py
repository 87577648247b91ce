"""The scheduler's host work per decode step -- ``schedule()`` then
``update_from_output()`` -- of a git revision against the working tree's, on the CPU:
``--batch`` requests of 200 prompt tokens decode one token per step for ``--steps``
steps (no model: the runner's output is made up). Each round runs both sides, each in
its own process (the revision's ``lmkit`` from an archive of its ``core/``), in
alternating order; medians of microseconds per step::

    python bench/scheduler_step.py --rev HEAD~1 --batch 32 256 --rounds 5

(This is host work between two engine steps; with the decode lookahead it overlaps the
GPU's step, and sets the step rate where it is the longer of the two.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from before_after import before_after, revision_tree, time_side  # noqa: E402


def time_steps(batch: int, steps: int) -> float:
    """Seconds per step of the importable ``lmkit``'s paged scheduler."""
    from lmkit.api import LMKitConfig
    from lmkit.api.request import Request
    from lmkit.api.runner_output import ModelRunnerOutput
    from lmkit.api.sampling_params import SamplingParams
    from lmkit.scheduler.paged import PagedScheduler

    config = LMKitConfig.model_validate({
        "model": {"model": "bench", "max_model_len": 4096}, "cache": {"block_size": 16},
        "scheduler": {"max_num_seqs": batch, "max_num_batched_tokens": 65536}})
    sched = PagedScheduler(config, num_blocks=batch * 300)
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        sched.add_request(Request(str(i), list(range(1, 201)), params))

    def step() -> None:
        so = sched.schedule()
        ids = list(so.num_scheduled_tokens)
        sched.update_from_output(so, ModelRunnerOutput(req_ids=ids,
                                                       sampled_token_ids=[[7]] * len(ids)))

    step()  # the prefill
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD", help="the 'before' git revision")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": revision_tree(args.rev, "core", Path(tmp)), "after": None}
        for batch in args.batch:
            before_after(f"batch {batch:4d}",
                         lambda name, batch=batch: time_side(
                             sides[name], "scheduler_step", f"time_steps({batch}, {args.steps})"),
                         args.rounds)

if __name__ == "__main__":
    main()
