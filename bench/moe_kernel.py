"""One Mixtral-8x7B MoE layer (hidden 4096, 8 experts of 14336, top-2, bfloat16) on
CUDA: lmkit's fused Triton MoE kernel (:func:`lmkit_kernels.moe.fused_moe`) against its
torch reference (one cuBLAS matmul pair per expert), per token count.

Reports milliseconds per layer, the bytes of the experts' weights the tokens touch per
second as a fraction of the copy bandwidth measured in the same run (decode sizes are
bound by reading the weights), and TFLOP/s (prefill sizes)::

    python bench/moe_kernel.py --out moe.json
"""

from __future__ import annotations

import argparse
import json

import torch
from lmkit_kernels.moe import fused_moe
from lmkit_kernels.moe_ref import fused_moe_ref
from triton.testing import do_bench

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 14336, 8, 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64,300,1024,4096")
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args()
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
        flops = 2 * tokens * TOP_K * 3 * INTER * HIDDEN
        row = {"tokens": tokens, "experts_touched": touched, "fused_ms": round(fused_ms, 4),
               "reference_ms": round(ref_ms, 4), "speedup": round(ref_ms / fused_ms, 2),
               "fused_weight_bw_fraction": round(
                   touched * expert_bytes / (fused_ms / 1e3) / copy_bw, 3),
               "fused_tflops": round(flops / (fused_ms / 1e3) / 1e12, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbs": round(copy_bw / 1e9),
              "shape": {"hidden": HIDDEN, "intermediate": INTER, "experts": EXPERTS,
                        "top_k": TOP_K, "dtype": "bfloat16"}, "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
