"""The sampling tensors of a decode step -- ``SamplingMetadata.build`` then
``adjust_logits`` -- of a git revision against the working tree's: ``--batch`` sampled
requests with ``--prompt-len`` prompt tokens and ``--output-len`` tokens generated so
far each decode one token per step for ``--steps`` steps, with the parameters of each
``--mix``:

* ``penalties``: temperature 0.7, repetition 1.1, presence 0.3 (OpenAI clients' usual);
* ``allowed``: ``allowed_token_ids`` of 4 ids (a classifier's labels);
* ``allowed2048``: 2,048 allowed ids (the most one request may send);
* ``bias``: ``logit_bias`` of 300 ids;
* ``plain``: temperature 0.7 alone (the reference: nothing kept per request).

Each round runs both sides, each in its own process (the revision's ``lmkit`` from an
archive of its ``core/``), in alternating order; medians of microseconds per step::

    python bench/sampling_state.py --rev HEAD~1 --batch 32 256 --mix penalties allowed
    python bench/sampling_state.py --device cuda --vocab 151936   # on a GPU

The penalties go through the sampling kernels a side's core has
(``SamplingKernels.apply_penalties``, plugin API 1.7; older cores: their torch path):
``--sampling-kernels`` for the working tree, ``--before-sampling-kernels`` for the
revision (``torch``: the core's; ``triton``: ``lmkit_plugins``' Triton ones, CUDA). The
Triton penalty kernel against the torch path, at one revision::

    python bench/sampling_state.py --device cuda --mix penalties --batch 32 256 \
        --before-sampling-kernels torch --sampling-kernels triton

The working tree keeps a request's logit bias, allowed ids and penalty counts across
steps (``lmkit.sample.row_cache``); a revision without that builds them every step.
"""

from __future__ import annotations

import argparse
import inspect
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from before_after import before_after, revision_tree, time_side  # noqa: E402

MIXES = ("penalties", "allowed", "allowed2048", "bias", "plain")
KERNELS = ("torch", "triton")


def mix_params(mix: str, i: int) -> dict:
    """Request ``i``'s sampling parameters in ``mix`` (one of :data:`MIXES`)."""
    if mix == "penalties":
        return {"temperature": 0.7, "repetition_penalty": 1.1, "presence_penalty": 0.3}
    if mix == "allowed":
        return {"temperature": 0.7, "allowed_token_ids": [10 + i % 7, 20, 30, 40]}
    if mix == "allowed2048":
        return {"temperature": 0.7, "allowed_token_ids": list(range(100 + i, 2148 + i))}
    if mix == "bias":
        return {"temperature": 0.7, "logit_bias": {t: 1.5 for t in range(i, i + 300)}}
    if mix == "plain":
        return {"temperature": 0.7}
    raise SystemExit(f"--mix {mix!r}: choose from {', '.join(MIXES)}")


def make_kernels(name: str, device):
    """The sampling kernels ``name`` (one of :data:`KERNELS`) for ``device``."""
    if name == "triton":
        from lmkit_plugins.sampling.triton_kernels import TritonSamplingKernels

        return TritonSamplingKernels(device=device)
    from lmkit.sample.kernels import TorchSamplingKernels

    return TorchSamplingKernels(device=device)


def time_steps(mix: str, batch: int, steps: int, vocab: int, prompt_len: int,
               output_len: int, device: str, kernels: str = "torch") -> float:
    """Seconds per step of the importable ``lmkit``'s sampling metadata and logit
    adjustments, as the runner builds them (with its cache when it has one), the
    penalties by the sampling kernels ``kernels`` where its core takes them."""
    import torch
    from lmkit.api.sampling_params import SamplingParams
    from lmkit.sample.draws import adjust_logits
    from lmkit.sample.metadata import SamplingMetadata
    from lmkit.sample.sampler import Sampler

    dev = torch.device(device)
    rng = random.Random(0)
    params = [SamplingParams(**mix_params(mix, i)) for i in range(batch)]
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    outputs = [[rng.randrange(vocab) for _ in range(output_len)] for _ in range(batch)]
    keys = [str(i) for i in range(batch)]
    extra: dict[str, Any] = {}
    if "cache" in inspect.signature(SamplingMetadata.build).parameters:
        extra = {"cache": Sampler().request_cache(vocab, dev), "keys": keys}
    logits = torch.randn(batch, vocab, device=dev)
    adjust: dict[str, Any] = {}
    if "kernels" in inspect.signature(adjust_logits).parameters:
        adjust = {"kernels": make_kernels(kernels, dev)}

    def step() -> None:
        md = SamplingMetadata.build(params, prompts, outputs, [None] * batch, [None] * batch,
                                    vocab, dev, **extra)
        adjust_logits(logits.clone(), md, **adjust)
        for out in outputs:
            out.append(rng.randrange(vocab))

    for _ in range(3):  # the first step (the prefill) builds what is kept; warm-up
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _side(core: Path | None, args: argparse.Namespace, mix: str, batch: int) -> float:
    kernels = args.before_sampling_kernels if core is not None else args.sampling_kernels
    return time_side(core, "sampling_state", f"time_steps({mix!r}, {batch}, {args.steps}, "
                     f"{args.vocab}, {args.prompt_len}, {args.output_len}, {args.device!r}, "
                     f"{kernels!r})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD", help="the 'before' git revision")
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--mix", nargs="+", default=list(MIXES), choices=MIXES)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sampling-kernels", default="torch", choices=KERNELS,
                    help="the working tree's penalties: the core's torch path or Triton")
    ap.add_argument("--before-sampling-kernels", default="torch", choices=KERNELS,
                    help="the revision's, where its core takes them (plugin API 1.7)")
    args = ap.parse_args()
    for name in ("steps", "rounds", "vocab"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": revision_tree(args.rev, "core", Path(tmp)), "after": None}
        for mix in args.mix:
            for batch in args.batch:
                before_after(f"{mix:11s} batch {batch:4d}",
                             lambda name, mix=mix, batch=batch: _side(sides[name], args, mix,
                                                                      batch),
                             args.rounds)


if __name__ == "__main__":
    main()
