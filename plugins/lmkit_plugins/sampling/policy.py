"""When the Triton sampling kernels run instead of torch: where they measured faster.

The figures are the table of docs/gpu.md ("Sampling kernels"), measured with
``python bench/sampling.py`` on an NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130; median of
50 calls; speedup = torch time / Triton time, both ending with the host copy the runner
needs). ``sample`` is one draw per row (no drafts); ``verify`` is rejection sampling of
4 drafts per request (the torch target distributions, then the kernel), by requests.

A step uses the kernel when the nearest measured shape (batch, then vocabulary, both on
a log scale) was at least :data:`MIN_SPEEDUP` faster for every filter the step uses
(``temp``: temperature only, ``top-k``, ``top-p``; a step using top-k and top-p needs
both to win). Greedy rows never use it: the Triton greedy path measured 3-8x slower
than ``torch.argmax``, so the sampler keeps the argmax. Re-measure and update
:data:`MEASURED` (and the docs table) when the kernels or the torch path change.
"""

from __future__ import annotations

import math

# Below this measured speedup the kernel is within noise of torch: keep torch.
MIN_SPEEDUP = 1.05

BATCHES = (1, 32, 256)
VOCABS = (49152, 151936)

# (op, mode) -> speedup per (batch, vocab), H100, from docs/gpu.md "Sampling kernels".
MEASURED: dict[tuple[str, str], dict[tuple[int, int], float]] = {
    ("sample", "top-p"): {(1, 49152): 1.61, (32, 49152): 2.11, (256, 49152): 2.53,
                          (1, 151936): 0.88, (32, 151936): 1.39, (256, 151936): 2.03},
    ("sample", "top-k"): {(1, 49152): 0.95, (32, 49152): 1.26, (256, 49152): 0.74,
                          (1, 151936): 0.34, (32, 151936): 0.53, (256, 151936): 0.52},
    ("sample", "temp"): {(1, 49152): 0.78, (32, 49152): 0.74, (256, 49152): 1.07,
                         (1, 151936): 0.93, (32, 151936): 1.10, (256, 151936): 1.65},
    ("verify", "top-p"): {(1, 49152): 1.38, (32, 49152): 1.33, (256, 49152): 1.09,
                          (1, 151936): 1.33, (32, 151936): 1.14, (256, 151936): 1.05},
    ("verify", "top-k"): {(1, 49152): 1.88, (32, 49152): 1.94, (256, 49152): 1.31,
                          (1, 151936): 2.28, (32, 151936): 1.57, (256, 151936): 1.17},
    ("verify", "temp"): {(1, 49152): 2.60, (32, 49152): 2.68, (256, 49152): 1.61,
                         (1, 151936): 2.07, (32, 151936): 1.96, (256, 151936): 1.31},
}


def _nearest(value: int, measured: tuple[int, ...]) -> int:
    return min(measured, key=lambda m: abs(math.log(max(value, 1) / m)))


def modes(has_top_k: bool, has_top_p: bool) -> tuple[str, ...]:
    """The measured modes a step's filters fall under."""
    if not has_top_k and not has_top_p:
        return ("temp",)
    return (("top-k",) if has_top_k else ()) + (("top-p",) if has_top_p else ())


def use_kernel(op: str, step_modes: tuple[str, ...], batch: int, vocab: int) -> bool:
    """Whether ``op`` (``"sample"``: ``batch`` rows; ``"verify"``: ``batch`` requests)
    over a ``vocab``-wide vocabulary measured faster in Triton for every mode."""
    shape = (_nearest(batch, BATCHES), _nearest(vocab, VOCABS))
    return all(MEASURED[(op, mode)][shape] >= MIN_SPEEDUP for mode in step_modes)
