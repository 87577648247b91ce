"""When the Triton sampling kernels run instead of torch: where they measured faster.

The figures are the table of docs/gpu.md ("Sampling kernels"), measured with
``python bench/sampling.py`` on an NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130; median of
50 calls), except top-p and top-k sampling over 151,936 logits, re-measured on an H200
for the multi-program threshold search of session 30 (no H100 was lent; the 49,152
columns are the H100's, of the previous search, which was slower); each figure is a
median of 50 calls; speedup = torch time / Triton time, both ending with the host copy the runner
needs). ``sample`` is one draw per row (no drafts); ``verify`` is rejection sampling of
4 drafts per request (the torch target distributions, then the kernel), by requests.

A step uses the kernel when the nearest measured shape (batch, then vocabulary, both on
a log scale) was at least :data:`MIN_SPEEDUP` faster for every filter the step uses
(``temp``: temperature only, ``top-k``, ``top-p``; a step using top-k and top-p needs
both to win). Greedy rows never use the sampling kernel's greedy path (3-8x slower
than ``torch.argmax``); their argmax takes :func:`lmkit_kernels.argmax.argmax_rows` for
few long rows (:data:`ARGMAX_MAX_ROWS`, :data:`ARGMAX_MIN_VOCAB`), else ``torch.argmax``. Re-measure and update
:data:`MEASURED` (and the docs table) when the kernels or the torch path change.
"""

from __future__ import annotations

import math

# Below this measured speedup the kernel is within noise of torch: keep torch.
MIN_SPEEDUP = 1.05

#: greedy rows' argmax through :func:`lmkit_kernels.argmax.argmax_rows` (two short
#: kernels) instead of ``torch.argmax`` for at most this many rows of at least
#: ARGMAX_MIN_VOCAB entries: torch reduces a row with one thread block (28 us per step at
#: batch 1 over 128,256 logits on an H100, W2's profile); the kernel spreads each row
#: over 4,096-wide chunks. Small vocabularies keep torch (one launch instead of two).
ARGMAX_MAX_ROWS = 64
ARGMAX_MIN_VOCAB = 32768


def uses_argmax_kernel(num_rows: int, vocab: int, device_type: str) -> bool:
    """Whether greedy rows' argmax takes lmkit's chunked kernel (see
    :data:`ARGMAX_MAX_ROWS`)."""
    return device_type == "cuda" and num_rows <= ARGMAX_MAX_ROWS and vocab >= ARGMAX_MIN_VOCAB

BATCHES = (1, 32, 256)
VOCABS = (49152, 151936)

# (op, mode) -> (batch, vocab) -> (torch us, Triton us): docs/gpu.md "Sampling kernels".
MEASURED: dict[tuple[str, str], dict[tuple[int, int], tuple[float, float]]] = {
    # the 151,936 columns of top-p and top-k: H200, session 30, the multi-program search
    # (the torch sampler from one run, the kernel alone from the block-size sweep); top-p
    # at 256 rows: the kernel with the race (RACE_MEASURED), session 31
    ("sample", "top-p"): {
        (1, 49152): (1117.3, 692.5), (32, 49152): (1407.4, 668.2),
        (256, 49152): (2667.2, 752.8), (1, 151936): (1231.0, 436.5),
        (32, 151936): (1740.5, 436.4), (256, 151936): (6342.4, 1445.3),
    },
    ("sample", "top-k"): {
        (1, 49152): (557.8, 589.4), (32, 49152): (737.4, 586.5), (256, 49152): (765.5, 1029.6),
        (1, 151936): (355.2, 388.0), (32, 151936): (556.6, 433.7),
        (256, 151936): (1559.6, 2403.2),
    },
    ("sample", "temp"): {
        (1, 49152): (260.4, 332.3), (32, 49152): (242.8, 327.6), (256, 49152): (390.5, 364.5),
        (1, 151936): (195.6, 210.7), (32, 151936): (439.0, 400.4),
        (256, 151936): (877.8, 530.7),
    },
    ("verify", "top-p"): {
        (1, 49152): (2058.4, 1494.5), (32, 49152): (3005.6, 2267.1),
        (256, 49152): (11304.0, 10335.1), (1, 151936): (1787.8, 1341.9),
        (32, 151936): (6358.1, 5593.8), (256, 151936): (34485.4, 32974.9),
    },
    ("verify", "top-k"): {
        (1, 49152): (1222.1, 649.1), (32, 49152): (1256.6, 647.8),
        (256, 49152): (3206.2, 2451.1), (1, 151936): (1194.8, 524.8),
        (32, 151936): (2081.9, 1327.7), (256, 151936): (8204.9, 6994.5),
    },
    ("verify", "temp"): {
        (1, 49152): (804.6, 309.7), (32, 49152): (865.9, 322.9), (256, 49152): (1907.2, 1185.8),
        (1, 151936): (606.8, 293.0), (32, 151936): (1299.5, 663.4),
        (256, 151936): (4468.1, 3408.1),
    },
}


#: top-p rows drawn by the race's checked winner (lmkit_kernels.sampling_race) against
#: the threshold search alone: (batch, vocab) -> (search us, race us), the kernel alone
#: (``bench/sampling.py --kernel-only --modes top-p``, then with ``--race-rounds 0``),
#: H200, session 31. The race takes 5 launches more (16 against 11), which the host pays
#: at small batches; from 256 rows its fewer passes over the logits win.
RACE_MEASURED: dict[tuple[int, int], tuple[float, float]] = {
    (1, 49152): (713.8, 1159.6), (32, 49152): (771.8, 1150.1), (256, 49152): (1102.4, 752.8),
    (1, 151936): (471.2, 740.9), (32, 151936): (526.7, 748.1), (256, 151936): (2830.3, 1445.3),
}


def uses_top_p_race(num_rows: int, vocab: int) -> bool:
    """Whether the sampling kernel draws top-p rows by checking the race's winner: where
    it measured faster than the search alone at the nearest measured shape."""
    search_us, race_us = RACE_MEASURED[(_nearest(num_rows, BATCHES), _nearest(vocab, VOCABS))]
    return race_us < search_us


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
    return all(speedup(op, mode, *shape) >= MIN_SPEEDUP for mode in step_modes)


def speedup(op: str, mode: str, batch: int, vocab: int) -> float:
    """The measured torch time over the Triton time at a measured shape."""
    torch_us, triton_us = MEASURED[(op, mode)][(batch, vocab)]
    return torch_us / triton_us
