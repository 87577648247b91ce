"""Per-layer time of lmkit's C paged decode attention (``paged_decode.c``) at batch 1.

A model's decode step attends once per layer over that layer's cache; with many
layers the caches together outgrow the L2 cache, so this cycles over ``--layers``
caches as a model does (``--layers 1``: one cache, always warm). The shape defaults to
SmolLM2-135M's (9 query heads, 3 KV heads, head size 64, blocks of 16 slots)::

    python bench/cpu_paged_decode.py --contexts 16,250,1000 --layers 30

The time includes the ctypes call (about 3 us; the decode-stack executor calls the
kernel from C and does not pay it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from lmkit_kernels.cpu.paged_decode import _library, paged_decode_unavailable_reason


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="16,250,1000")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = _library()[0]
    if lib is None:
        raise SystemExit(f"the kernel is unavailable: {paged_decode_unavailable_reason()}")
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_size, args.block_size
    for ctx in (int(c) for c in args.contexts.split(",")):
        nb = -(-ctx // bs)
        caches = [torch.randn(2, nb, bs, kvh, d) for _ in range(args.layers)]
        table = torch.arange(nb, dtype=torch.int32)[None].contiguous()
        seq = torch.tensor([ctx], dtype=torch.int32)
        q, out = torch.randn(1, h * d), torch.empty(1, h * d)
        calls = [(q.data_ptr(), h * d, c.data_ptr(), nb * bs, table.data_ptr(), nb,
                  seq.data_ptr(), out.data_ptr(), 1, h, kvh, d, bs, d ** -0.5, 0, args.threads)
                 for c in caches]
        times = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            for call in calls:
                lib.lmkit_paged_decode(*call)
            times.append((time.perf_counter() - t) / len(calls) * 1e6)
        print(f"context {ctx}: {statistics.median(times):.1f} us per layer "
              f"(min {min(times):.1f}, max {max(times):.1f}; {args.layers} layers' caches)")


if __name__ == "__main__":
    main()
