"""Compile lmkit's decode attention kernel and the plain weight-streaming GEMV for sm_90
(H100/H200) on a machine without a GPU, with Triton's bundled ``ptxas``, and report each
variant's shared memory, registers and register spills (``cuobjdump -res-usage``).

Run as a script (Triton must not be in interpreter mode, so the test runs it in a
subprocess): ``python offline_sm90_decode.py '[VARIANT, ...]'`` prints one JSON object
per variant. A variant is ``["decode", num_heads, num_kv_heads, head_size, num_reqs,
merge_at_once]`` (:func:`lmkit_kernels.paged_attention.paged_attention`'s decode launch:
its tiles, split count and merge as it chooses them on a 132-SM GPU) or ``["gemv",
out_features]`` (:func:`lmkit_plugins.models.fused_ops.small_m_tiles`' launch of
:func:`lmkit_kernels.gemv.small_m_linear`). Arguments are specialised as a launch
specialises them: pointers 16-byte aligned, strides and sizes divisible by 16 (the
block-table stride is never specialised); without that, the compiler cannot vectorise the
cache loads and spills registers that the real launch does not.
"""

from __future__ import annotations

import json
import os
import sys

from offline_sm90 import resource_usage

SMS = 132  # an H100 SXM / H200


def _compile(kernel, signature: dict, constants: dict, aligned: list[str], num_warps: int,
             num_stages: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    names = kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    for param in kernel.params:  # constexprs left at their defaults
        if param.is_constexpr and param.name not in constants:
            constants[param.name] = param.default
            signature[param.name] = "constexpr"
    return triton_compile(ASTSource(kernel, signature, constants, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages,
                                   "launch_pdl": True})


def decode(num_heads: int, num_kv_heads: int, head_size: int, num_reqs: int,
           merge_at_once: bool) -> dict:
    import torch
    from lmkit_kernels import paged_attention as pa
    from lmkit_kernels.paged_decode import paged_decode_kernel

    pa._sm_count = lambda device: SMS  # the split choice of an H100/H200
    group = num_heads // num_kv_heads
    head_pad = max(16, 1 << (head_size - 1).bit_length())
    splits = pa.choose_decode_splits(num_reqs, num_kv_heads, torch.device("cuda"))
    block_n, num_warps, num_stages = pa._decode_config(head_pad, torch.bfloat16, False,
                                                       num_reqs, group)
    floats = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "counter_ptr": "*i32",
              "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
              "block_tables_ptr": "*i32"}
    signature, aligned = {}, []
    constants = {"NUM_HEADS": num_heads, "NUM_KV_HEADS": num_kv_heads, "GROUP": group,
                 "ROWS": max(16, 1 << (group - 1).bit_length()), "NUM_SPLITS": splits,
                 "FUSED_MERGE": splits > 1, "MERGE_AT_ONCE": merge_at_once,
                 "MERGE_ROWS": 1 << (group - 1).bit_length(), "BLOCK_N": block_n,
                 "HEAD_SIZE": head_size, "HEAD_PAD": head_pad, "PAGE_SIZE": 16,
                 "DOT_F32": False, "DOT_IEEE": False, "USE_PDL": True, "KV_LINE": 64,
                 "KV_LINES": head_size // 64}
    for param in paged_decode_kernel.params:
        name = param.name
        if name in constants or param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = floats.get(name, "*bf16")
            aligned.append(name)
        elif name in ("scale_log2", "v_scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride") and name != "stride_bt_req":
                aligned.append(name)
    kernel = _compile(paged_decode_kernel, signature, constants, aligned, num_warps,
                      num_stages)
    fields = resource_usage(kernel)
    return {"kind": "decode", "num_heads": num_heads, "num_kv_heads": num_kv_heads,
            "head_size": head_size, "num_reqs": num_reqs, "merge_at_once": merge_at_once,
            "splits": splits, "tiles": [block_n, num_warps, num_stages],
            "prefetches": kernel.asm["ptx"].count("prefetch.global.L2"),
            "shared": kernel.metadata.shared, "registers": int(fields["REG"]),
            "stack": int(fields["STACK"])}


def gemv(out_features: int) -> dict:
    from lmkit_kernels.gemv import _small_m_linear_kernel
    from lmkit_plugins.models.fused_ops import small_m_tiles

    tiles = small_m_tiles(out_features)
    pointers = ["x_ptr", "w_ptr", "b_ptr", "out_ptr"]
    ints = ["M", "N", "K", "stride_xm", "stride_wn", "stride_om"]
    constants = {"HAS_BIAS": False, "BLOCK_N": tiles["block_n"], "BLOCK_K": tiles["block_k"],
                 "DOT_F32": False, "HAS_SCALE": False, "USE_PDL": True, "PF_LINE": 64,
                 "PF_LINES": tiles["block_k"] // 64, "GLU_OUT": False, "ACCURATE_EXP": True}
    signature = {**{p: "*bf16" for p in pointers}, **{i: "i32" for i in ints},
                 "s_ptr": "*fp32", **{c: "constexpr" for c in constants}}
    kernel = _compile(_small_m_linear_kernel, signature, constants,
                      pointers + [i for i in ints if i != "M"], tiles["num_warps"],
                      tiles["num_stages"])
    fields = resource_usage(kernel)
    return {"kind": "gemv", "out_features": out_features, "tiles": tiles,
            "shared": kernel.metadata.shared, "registers": int(fields["REG"]),
            "stack": int(fields["STACK"])}


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for kind, *args in json.loads(sys.argv[1]):
        print(json.dumps(decode(*args) if kind == "decode" else gemv(*args)), flush=True)
