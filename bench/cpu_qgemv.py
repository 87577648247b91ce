"""CPU decode projections over GGUF-quantized weights against the memory read rate: lmkit's
C quantized GEMV (:mod:`lmkit_kernels.cpu.qgemv`) on every projection of a model's
decode step, as the model calls it (one bound function per weight).

SmolLM2-135M in its default GGUF (Q4_1 layers, Q8_0 tied LM head) reads about 96 MB of
packed weights per token, more than a core's share of the shared L3 cache on the hosts
this runs on, so a step is bound by how fast one core streams them. This times the 121
projections back to back (the weights packed in the model's load order: per layer down,
gate-up, output, QKV; the step runs them QKV, output, gate-up, down), per projection
shape (us per call and GB/s, each shape over its 30 distinct weights), and the fixed
cost of a call (a 16 x 32 weight: the Python frame, ctypes, the output tensor, the
activation quantization); beside a plain streaming read (``sum`` over a tensor of the
same size) in the same rounds. Every build this CPU runs is timed (AVX-512 VNNI, AVX2),
rounds alternate the builds (the machines this runs on drift)::

    OMP_NUM_THREADS=1 python bench/cpu_qgemv.py --threads 1 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from lmkit_kernels.cpu import qgemv

Q4_1, Q8_0 = qgemv.QTYPES["Q4_1"], qgemv.QTYPES["Q8_0"]
# model: [(out, in, ggml type) per projection in step order], layer count, LM head
SHAPES = {
    "smollm2-135m": ([(960, 576, Q4_1), (576, 576, Q4_1), (3072, 576, Q4_1),
                      (576, 1536, Q4_1)], 30, (49152, 576, Q8_0)),
}
LOAD_ORDER = (3, 2, 1, 0)  # a layer's projections in the order the GGUF loader packs them


def _step_weights(model: str) -> list[tuple[int, int, int]]:
    layer, num_layers, head = SHAPES[model]
    return layer * num_layers + [head]


def _pack_all(shapes: list[tuple[int, int, int]], gen: torch.Generator
              ) -> list[qgemv.PackedWeight]:
    """Random blocks packed in load order (the arena's order), returned in step order."""
    num_layer_weights = len(shapes) - 1
    order = [num_layer_weights] + [i0 + j for i0 in range(0, num_layer_weights, 4)
                                   for j in LOAD_ORDER]
    packed: dict[int, qgemv.PackedWeight] = {}
    for i in order:
        n, k, t = shapes[i]
        packed[i] = qgemv.pack_weight(t, qgemv.random_blocks(t, n, k, gen), k)
    return [packed[i] for i in range(len(shapes))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = qgemv.qgemv_variants()
    if not variants:
        raise SystemExit(f"quantized GEMV kernel not available: "
                         f"{qgemv.qgemv_unavailable_reason()}")
    shapes = _step_weights(args.model)
    weights = _pack_all(shapes, torch.Generator().manual_seed(0))
    nbytes = [w.data.numel() for w in weights]
    total = sum(nbytes)
    xs = {k: torch.randn(1, k) for _, k, _ in shapes}
    stream = torch.randn(total // 4)
    tiny = qgemv.pack_weight(Q4_1, qgemv.random_blocks(Q4_1, 16, 32, torch.Generator()), 32)
    x_tiny = torch.randn(1, 32)

    step_s: dict[str, list[float]] = {isa: [] for isa in variants}
    call_s: dict[str, list[float]] = {isa: [] for isa in variants}
    per_shape: dict[str, list[list[float]]] = {isa: [[] for _ in shapes] for isa in variants}
    stream_s: list[float] = []
    for _ in range(args.rounds):
        for isa, fn in variants.items():
            for w in weights:  # warm: the weights in cache as a step leaves them
                fn(xs[w.k], w, None)
            times = []
            for _ in range(args.steps):
                for i, w in enumerate(weights):
                    t0 = time.perf_counter()
                    fn(xs[w.k], w, None)
                    per_shape[isa][i].append(time.perf_counter() - t0)
                times.append(sum(per_shape[isa][i][-1] for i in range(len(weights))))
            step_s[isa].append(statistics.median(times))
            t0 = time.perf_counter()
            for _ in range(1000):
                fn(x_tiny, tiny, None)
            call_s[isa].append((time.perf_counter() - t0) / 1000)
        t0 = time.perf_counter()
        stream.sum()
        stream_s.append(time.perf_counter() - t0)

    med = statistics.median
    results: dict = {"model": args.model, "threads": torch.get_num_threads(),
                     "weight_mb": total / 1e6, "stream_gb_per_s": total / med(stream_s) / 1e9,
                     "builds": {}}
    print(f"{args.model}: {len(shapes)} projections, {total / 1e6:.1f} MB packed, "
          f"{torch.get_num_threads()} thread(s); stream read (sum) "
          f"{total / med(stream_s) / 1e9:.1f} GB/s")
    layer_shapes = shapes[:4] + shapes[-1:]
    for isa in variants:
        s = med(step_s[isa])
        build = {"step_ms": 1e3 * s, "gb_per_s": total / s / 1e9,
                 "step_ms_range": [1e3 * min(step_s[isa]), 1e3 * max(step_s[isa])],
                 "call_us": 1e6 * med(call_s[isa]), "shapes": {}}
        print(f"  {isa:<11} step {1e3 * s:6.2f} ms ({build['step_ms_range'][0]:.2f}-"
              f"{build['step_ms_range'][1]:.2f})  {total / s / 1e9:5.1f} GB/s  "
              f"fixed cost {build['call_us']:.2f} us/call")
        for n, k, t in layer_shapes:
            idx = [i for i, sh in enumerate(shapes) if sh == (n, k, t)]
            us = med([v for i in idx for v in per_shape[isa][i]])
            gbs = nbytes[idx[0]] / us / 1e9
            name = f"{n}x{k} {'Q8_0' if t == Q8_0 else 'Q4_1'}"
            build["shapes"][name] = {"us": 1e6 * us, "gb_per_s": gbs}
            print(f"    {name:<16} {1e6 * us:8.1f} us  {gbs:5.1f} GB/s")
        results["builds"][isa] = build
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
