"""One MoE layer on CUDA (``--shape``: Mixtral-8x7B, hidden 4096, 8 experts of 14336,
top-2; or DeepSeek-V2-Lite, hidden 2048, 64 experts of 1408, top-6; bfloat16): lmkit's
fused Triton MoE kernel (:func:`lmkit_kernels.moe.fused_moe`) with its default tiles and
with large tiles (128 x 128, 8 warps: a candidate for large token counts), its torch
reference (one cuBLAS matmul pair per expert), and the route a model layer takes
(:class:`lmkit_plugins.models.fused_ops.MoEExperts`: the fused kernel below
``FUSED_MOE_MAX_ROWS_PER_EXPERT`` rows per expert, the reference from there on), per
token count.

Reports milliseconds per layer, the bytes of the experts' weights the tokens touch per
second as a fraction of the copy bandwidth measured in the same run (decode sizes are
bound by reading the weights), and TFLOP/s (prefill sizes)::

    python bench/moe_kernel.py --out moe.json
    python bench/moe_kernel.py --shape deepseek-v2-lite --out moe_v2lite.json
"""

from __future__ import annotations

import argparse
import json

import torch
from lmkit_kernels.moe import fused_moe
from lmkit_kernels.moe_ref import fused_moe_ref
from lmkit_plugins.models.fused_ops import MoEExperts, moe_max_rows_per_expert
from triton.testing import do_bench

#: (hidden, expert intermediate, experts, top_k)
SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "deepseek-v2-lite": (2048, 1408, 64, 6)}
#: fused_moe keyword arguments of the large-tile candidate
LARGE_TILES = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64,300,512,768,1024,2048,4096")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-8x7b")
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args()
    HIDDEN, INTER, EXPERTS, TOP_K = SHAPES[args.shape]  # noqa: N806
    routed = MoEExperts(fused_moe, fused_moe_ref, moe_max_rows_per_expert())
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device=dev)
           * HIDDEN ** -0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device=dev) * INTER ** -0.5).bfloat16()
    src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    copy_bw = 2 * src.numel() / (do_bench(lambda: src.clone()) / 1e3)
    expert_bytes = 3 * INTER * HIDDEN * 2
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, generator=g, device=dev).bfloat16()
        weights, ids = torch.randn(tokens, EXPERTS, generator=g, device=dev).softmax(-1).topk(TOP_K)
        touched = int(ids.unique().numel())
        fused_ms = do_bench(lambda: fused_moe(x, w13, w2, weights, ids))  # noqa: B023
        ref_ms = do_bench(lambda: fused_moe_ref(x, w13, w2, weights, ids))  # noqa: B023
        large_ms = do_bench(lambda: fused_moe(x, w13, w2, weights, ids,  # noqa: B023
                                              **LARGE_TILES))
        routed_ms = do_bench(lambda: routed(x, w13, w2, weights, ids))  # noqa: B023
        flops = 2 * tokens * TOP_K * 3 * INTER * HIDDEN
        row = {"tokens": tokens, "experts_touched": touched, "fused_ms": round(fused_ms, 4),
               "reference_ms": round(ref_ms, 4), "speedup": round(ref_ms / fused_ms, 2),
               "fused_large_tiles_ms": round(large_ms, 4),
               "routed_ms": round(routed_ms, 4),
               "routed_to": "fused" if routed.uses_fused(tokens, TOP_K, EXPERTS) else "reference",
               "fused_weight_bw_fraction": round(
                   touched * expert_bytes / (fused_ms / 1e3) / copy_bw, 3),
               "fused_tflops": round(flops / (fused_ms / 1e3) / 1e12, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbs": round(copy_bw / 1e9),
              "shape": {"name": args.shape, "hidden": HIDDEN, "intermediate": INTER, "experts": EXPERTS,
                        "top_k": TOP_K, "dtype": "bfloat16"},
              "max_rows_per_expert": routed.max_rows_per_expert, "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
