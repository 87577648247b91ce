"""The core's torch sampler against the Triton sampling and rejection kernels.

Issue 16 asks to wire ``lmkit_kernels.sampling.sample`` and
``lmkit_kernels.rejection_sample.rejection_sample`` in where they are faster on the GPU,
else delete them. This times, per shape, on the same logits:

* **sample** (one token per request, no drafts): ``torch`` is the core's
  :class:`lmkit.sample.sampler.Sampler` on prebuilt :class:`SamplingMetadata` (what the
  model runner calls each step); ``triton`` is ``sample(logits, temperature, top_k,
  top_p)`` (temperature -> top-k -> top-p, the part of the pipeline it covers).
* **verify** (``--k`` drafts per request): ``torch`` is ``Sampler.sample_requests``
  (greedy: the argmax host walk the runner takes); ``triton`` is the core's
  ``compute_probs`` then ``rejection_sample`` (the kernel needs the target
  distributions), with the noise it needs drawn in the timed region.

``wired`` is the core's sampler with the ``triton`` sampling kernels
(``lmkit_plugins.sampling``), which run the kernels only where this table measured
them faster (their policy) and torch elsewhere: what the engine does on CUDA by default
(greedy verification takes the runner's argmax walk on both, so it has no ``wired``).
Both sides end with the device-to-host copy of the tokens the runner needs. Modes:
``greedy`` (temperature 0), ``temp`` (temperature 0.8), ``top-k`` (0.8, k=50),
``top-p`` (0.8, p=0.9) and ``top-k+p`` (0.8, k=50, p=0.9). Times are medians of
``--iters`` calls after ``--warmup``, in microseconds (CUDA events on CUDA)::

    python bench/sampling.py                                   # CUDA: the full table
    python bench/sampling.py --device cuda --batches 1 32 256 --vocabs 49152 151936
    TRITON_INTERPRET=1 python bench/sampling.py --device cpu --smoke   # CPU smoke test

``--rev REV`` also times ``sample`` of git revision REV's ``kernels/`` (column
``rev_us``; run in a subprocess with that folder first on ``PYTHONPATH``), a before /
after of a kernel change in one run; ``--kernel-only`` times ``sample`` alone::

    python bench/sampling.py --rev HEAD --batches 1 32 256 --vocabs 151936 --k 0 \
        --modes temp top-k top-p top-k+p

``--race-rounds 0`` times the top-p threshold search alone for every row (the
default draws top-p rows by checking the race's winner, :mod:`lmkit_kernels.
sampling_race`).

``--device cpu`` runs the kernels in Triton's interpreter (set here when not set), so
its Triton numbers mean nothing: it only checks that the script runs. ``--no-triton``
times the torch side alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

MODES = {  # name -> (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "temp": (0.8, 0, 1.0),
    "top-k": (0.8, 50, 1.0),
    "top-p": (0.8, 0, 0.9),
    "top-k+p": (0.8, 50, 0.9),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--vocabs", type=int, nargs="+", default=[49152, 151936])
    p.add_argument("--modes", nargs="+", default=["greedy", "top-p", "top-k", "top-k+p", "temp"],
                   choices=list(MODES))
    p.add_argument("--k", type=int, default=4, help="drafts per request in 'verify' (0: off)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and few iterations (a CPU check that the script runs)")
    p.add_argument("--no-triton", action="store_true", help="time the torch side only")
    p.add_argument("--kernel-only", action="store_true",
                   help="time the Triton sample alone (no torch, wired or verify rows)")
    p.add_argument("--rev", help="also time the Triton sample of this git revision's kernels")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--race-rounds", type=int,
                   help="the Triton sample's race_rounds (0: the top-p threshold search for "
                        "every row; default: the kernel's own)")
    args = p.parse_args(argv)
    if args.kernel_only and args.no_triton:
        p.error("--kernel-only times the Triton kernel: it cannot go with --no-triton")
    if args.rev and args.no_triton:
        p.error("--rev times the revision's Triton kernel: it cannot go with --no-triton")
    if args.kernel_only:
        args.k = 0
    if args.smoke:
        args.batches, args.vocabs, args.iters, args.warmup = [1, 3], [64], 2, 1
    return args


def timer(device: Any, iters: int, warmup: int) -> Callable[[Callable[[], Any]], float]:
    """``time(fn)``: the median microseconds of one ``fn()`` call."""
    import torch

    def time_cuda(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def time_cpu(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    return time_cuda if device.type == "cuda" else time_cpu


def case(mode: str, num_reqs: int, vocab: int, k: int, device: Any) -> dict[str, Any]:
    """Logits, metadata and kernel arguments for ``num_reqs`` requests, ``k + 1`` rows
    each (``k = 0``: one row)."""
    import torch
    from lmkit.api.sampling_params import SamplingParams
    from lmkit.sample.metadata import SamplingMetadata

    temperature, top_k, top_p = MODES[mode]
    rows = num_reqs * (k + 1)
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    md = SamplingMetadata.build([params] * rows, [[1]] * rows, [[]] * rows, [None] * rows,
                                [None] * rows, vocab, device)
    drafts = torch.randint(vocab, (num_reqs, k), generator=g)
    # half of the drafts are the argmax, so greedy verification accepts some
    best = logits.argmax(dim=-1).cpu().view(num_reqs, k + 1)[:, :k]
    drafts = torch.where(torch.rand(num_reqs, k, generator=g) < 0.5, best, drafts)
    full = lambda value, dtype: torch.full((rows,), value, dtype=dtype, device=device)  # noqa: E731
    return dict(
        logits=logits, md=md, drafts=drafts.tolist(),
        draft_ids=drafts.flatten().to(device),
        cu_num_drafts=torch.arange(1, num_reqs + 1, device=device) * k,
        is_greedy=torch.full((num_reqs,), temperature == 0.0, device=device),
        temperature=full(temperature, torch.float32),
        top_k=full(top_k, torch.int64) if top_k else None,
        top_p=full(top_p, torch.float32) if top_p < 1.0 else None)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    from lmkit.sample.draws import compute_probs
    from lmkit.sample.sampler import Sampler

    device = torch.device(args.device)
    kernels: tuple[Callable, Callable | None, Any] | None = None
    if args.kernel_only:  # the kernel alone: another revision's plugins may not match it
        from lmkit_kernels.sampling import sample
        kernels = (_with_rounds(sample, args.race_rounds), None, None)
    elif not args.no_triton:
        try:
            from lmkit_kernels.rejection_sample import rejection_sample
            from lmkit_kernels.sampling import sample
            from lmkit_plugins.sampling.triton_kernels import TritonSamplingKernels
            kernels = (_with_rounds(sample, args.race_rounds), rejection_sample,
                       Sampler(TritonSamplingKernels(device=device)))
        except ImportError as exc:
            print(f"triton kernels unavailable ({exc}): timing torch only", file=sys.stderr)
    time_us = timer(device, args.iters, args.warmup)
    sampler = Sampler()
    rows = []
    for vocab in args.vocabs:
        for batch in args.batches:
            for mode in args.modes:
                c = case(mode, batch, vocab, 0, device)
                row: dict[str, Any] = dict(op="sample", mode=mode, batch=batch, vocab=vocab)
                if not args.kernel_only:
                    row["torch_us"] = time_us(functools.partial(draw, sampler, c))
                if kernels is not None:
                    row["triton_us"] = time_us(functools.partial(kernel_draw, kernels[0], c))
                if kernels is not None and kernels[2] is not None:
                    row["wired_us"] = time_us(functools.partial(draw, kernels[2], c))
                rows.append(row)
                if args.k > 0:
                    rows.append(verify_row(c, mode, batch, vocab, args.k, device, sampler,
                                           kernels, time_us, compute_probs))
                print(format_row(rows[-2 if args.k > 0 else -1]), flush=True)
                if args.k > 0:
                    print(format_row(rows[-1]), flush=True)
    return rows


def draw(sampler: Any, c: dict[str, Any]) -> list[int]:
    """One step of ``sampler`` on case ``c``, to the host."""
    return sampler(c["logits"], c["md"]).sampled_token_ids.tolist()


def _with_rounds(sample: Callable, rounds: int | None) -> Callable:
    """``sample`` with ``race_rounds=rounds`` when given (this tree's kernels)."""
    return sample if rounds is None else functools.partial(sample, race_rounds=rounds)


def kernel_draw(sample: Callable, c: dict[str, Any]) -> list[int]:
    """``lmkit_kernels.sampling.sample`` on case ``c``, to the host."""
    return sample(c["logits"], temperature=c["temperature"], top_k=c["top_k"],
                  top_p=c["top_p"]).tolist()


def revision_rows(args: argparse.Namespace, argv: list[str]) -> list[dict[str, Any]]:
    """The ``--kernel-only`` rows of this bench run with ``args.rev``'s ``kernels/``
    first on the path (a fresh process: the two ``lmkit_kernels`` cannot share one)."""
    import subprocess
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from before_after import env_first_on_path, revision_tree

    with tempfile.TemporaryDirectory() as tmp:
        kernels = revision_tree(args.rev, "kernels", Path(tmp))
        out = Path(tmp) / "rev.json"
        cmd = [sys.executable, __file__, *strip_rev(argv), "--kernel-only", "--json", str(out)]
        subprocess.run(cmd, env=env_first_on_path(kernels), check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["rows"]


def strip_rev(argv: list[str]) -> list[str]:
    """``argv`` without ``--rev REV`` and ``--json PATH`` (either spelling)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--rev", "--json"):
            skip = True
        elif not arg.startswith(("--rev=", "--json=")):
            kept.append(arg)
    return kept


def verify_row(c: dict[str, Any], mode: str, batch: int, vocab: int, k: int, device: Any,
               sampler: Any, kernels: Any, time_us: Callable, compute_probs: Callable
               ) -> dict[str, Any]:
    """One ``verify`` row: ``k`` drafts per request."""
    import torch

    v = case(mode, batch, vocab, k, device)
    row: dict[str, Any] = dict(op=f"verify k={k}", mode=mode, batch=batch, vocab=vocab)
    if mode == "greedy":  # the runner's all-greedy path: argmax, host walk
        row["torch_us"] = time_us(lambda: sampler.verify_greedy(v["logits"], v["drafts"]))
    else:
        row["torch_us"] = time_us(lambda: sampler.sample_requests(v["logits"], v["md"],
                                                                  v["drafts"]))
    if kernels is not None:
        rejection_sample = kernels[1]
        num_drafts = v["draft_ids"].numel()

        def kernel() -> Any:
            probs = compute_probs(v["logits"].clone(), v["md"])
            noise = torch.empty_like(probs).exponential_()
            uniform = torch.rand(num_drafts, device=device)
            out, num_accepted = rejection_sample(probs, v["draft_ids"], v["cu_num_drafts"],
                                                 uniform, noise, k, v["is_greedy"])
            return torch.cat([out.flatten(), num_accepted]).tolist()

        row["triton_us"] = time_us(kernel)
        if mode != "greedy":
            wired = kernels[2]
            row["wired_us"] = time_us(lambda: wired.sample_requests(v["logits"], v["md"],
                                                                    v["drafts"]))
    return row


def format_row(row: dict[str, Any]) -> str:
    def us(key: str) -> str:
        return f"{row[key]:10.1f}" if row.get(key) else "         -"

    torch_us, triton = row.get("torch_us"), row.get("triton_us")
    speedup = f"{torch_us / triton:6.2f}x" if torch_us and triton else "      -"
    line = (f"{row['op']:<11} {row['mode']:<7} {row['batch']:>5} {row['vocab']:>7} "
            f"{us('torch_us')} {us('triton_us')} {speedup} {us('wired_us')}")
    if "rev_us" in row:
        line += f" {us('rev_us')}"
    return line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --smoke for a smoke test", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreted)"
    print(f"# {name}, torch {torch.__version__}; median us of {args.iters} calls; "
          "speedup = torch / triton; wired = the sampler with the triton sampling kernels")
    header = (f"{'op':<11} {'mode':<7} {'batch':>5} {'vocab':>7} {'torch_us':>10} "
              f"{'triton_us':>10} {'speedup':>7} {'wired_us':>10}")
    print(header)
    rows = measure(args)
    if args.rev:
        before = {(r["op"], r["mode"], r["batch"], r["vocab"]): r["triton_us"]
                  for r in revision_rows(args, argv)}
        print(f"# rev_us: the Triton sample of {args.rev}'s kernels")
        print(f"{header} {'rev_us':>10}")
        for row in rows:
            row["rev_us"] = before.get((row["op"], row["mode"], row["batch"], row["vocab"]))
            print(format_row(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
