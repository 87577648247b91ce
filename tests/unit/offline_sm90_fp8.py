"""Compile lmkit's one-row FP8 kernel (:mod:`lmkit_kernels.fp8_gemv`, plain and with its
folds, :mod:`lmkit_kernels.fp8_gemv_fold`) for sm_90 (H100/H200) on a machine without a
GPU, with Triton's bundled ``ptxas``, and report each variant's shared memory,
registers, register spills and whether its PTX waits on the previous kernel
(``griddepcontrol.wait``, programmatic dependent launch).

Run as a script (Triton must not be in interpreter mode, so the test runs it in a
subprocess): ``python offline_sm90_fp8.py '[[mode, has_residual, N, K, pipeline,
use_pdl(, block_n)], ...]'`` prints one JSON object per variant, launched with the FP8
method's default one-row tiles (:data:`lmkit_kernels.fp8_gemv.ROW_TILES`; ``block_n``
instead of its rows per program where given) and, with PDL, the
weight prefetch :func:`lmkit_kernels.pdl.prefetch_args` asks for.
"""

from __future__ import annotations

import json
import os
import sys

from offline_sm90 import resource_usage


def _compile(mode: str, has_residual: bool, n: int, k: int, pipeline: bool,
             use_pdl: bool, block_n: int | None = None) -> dict:
    from lmkit_kernels.checks import next_power_of_2
    from lmkit_kernels.fp8_gemv import MAX_NORM_BLOCK, MODES, ROW_TILES, _fp8_row_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    block_k, warps = ROW_TILES[1:]
    block_n = block_n or ROW_TILES[0]
    types = {"x_ptr": "*bf16", "res_ptr": "*bf16", "g_ptr": "*bf16", "w_ptr": "*fp8e4nv",
             "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
             "N": "i32", "K": "i32", "stride_wn": "i32", "inv_k": "fp32", "eps": "fp32"}
    constants = {"MODE": MODES[mode], "HAS_RESIDUAL": has_residual, "HAS_BIAS": False,
                 "BLOCK_N": block_n, "BLOCK_K": block_k, "PIPELINE": pipeline,
                 "NORM_BLOCK": min(next_power_of_2(k), MAX_NORM_BLOCK), "GPU_MATH": True,
                 "USE_PDL": use_pdl, "PF_LINE": 128, "PF_LINES": block_k // 128 if use_pdl
                 else 0}
    signature = {**types, **{c: "constexpr" for c in constants}}
    # what the launch specialises on: 16-byte aligned pointers, sizes divisible by 16
    names = _fp8_row_kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a, t in types.items() if t.startswith("*") or t == "i32"}
    kernel = triton_compile(ASTSource(_fp8_row_kernel, signature, constants, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps})
    fields = resource_usage(kernel)
    ptx = kernel.asm["ptx"]
    return {"mode": mode, "has_residual": has_residual, "N": n, "K": k,
            "pipeline": pipeline, "use_pdl": use_pdl, "block_n": block_n,
            "shared": kernel.metadata.shared,
            "registers": int(fields["REG"]), "stack": int(fields["STACK"]),
            "waits": "griddepcontrol.wait" in ptx,
            "launches_dependents": "griddepcontrol.launch_dependents" in ptx,
            "prefetches": "prefetch.global.L2" in ptx, "fma": "fma.rn.f32" in ptx,
            "mul_rn": "mul.rn.f32" in ptx}


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    for variant in json.loads(sys.argv[1]):
        print(json.dumps(_compile(*variant)), flush=True)
