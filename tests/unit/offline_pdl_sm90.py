"""Compile lmkit's decode-step kernels for sm_90 (H100/H200) with programmatic dependent
launch on and off, without a GPU, and report which grid-dependency and prefetch
instructions their PTX holds.

Run as a script (Triton must not be in interpreter mode, so the test runs it in a
subprocess): ``python offline_pdl_sm90.py`` prints one JSON object per (kernel, PDL on
or off): ``{"kernel", "pdl", "wait", "launch_dependents", "prefetch", "launch_pdl"}``
(instruction counts; ``launch_pdl``: the launch flag the compiled kernel carries).
Argument types follow each kernel's parameter names (pointers as bf16 unless named
otherwise); constants are a Llama-3.1-8B decode step's.
"""

from __future__ import annotations

import json
import os

# pointer arguments that are not bf16 activations/weights
_POINTER_TYPES = {"pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "val_ptr": "*fp32",
                  "idx_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "counter_ptr": "*i32",
                  "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
                  "block_tables_ptr": "*i32", "slot_ptr": "*i64", "slot_mapping_ptr": "*i64",
                  "cos_ptr": "*fp32", "sin_ptr": "*fp32", "s_ptr": "*fp32"}
_FLOATS = {"scale_log2", "v_scale", "inv_k_scale", "inv_v_scale", "eps", "inv_head_size",
           "inv_hidden_size", "inv_k"}


def _variants(pdl: bool) -> list[tuple[str, object, dict, int]]:
    from lmkit_kernels.activation import _silu_and_mul_kernel
    from lmkit_kernels.argmax import _chunk_argmax_kernel, _rows_argmax_kernel
    from lmkit_kernels.cache_write import _reshape_and_cache_kernel
    from lmkit_kernels.gemv import _small_m_linear_kernel
    from lmkit_kernels.gemv_fold import _fold_linear_kernel
    from lmkit_kernels.norm import _rms_norm_kernel
    from lmkit_kernels.paged_decode import paged_decode_kernel, reduce_splits_kernel
    from lmkit_kernels.rotary import _rotary_qk_kernel
    from lmkit_kernels.rotary_cos_sin import _cos_sin_kernel

    lines = 8 if pdl else 0
    return [
        ("small_m_linear", _small_m_linear_kernel,
         {"HAS_BIAS": False, "BLOCK_N": 16, "BLOCK_K": 512, "DOT_F32": False,
          "HAS_SCALE": False, "PF_LINE": 64, "PF_LINES": lines}, 4),
        ("gemv_fold", _fold_linear_kernel,
         {"SILU_MUL": False, "HAS_RESIDUAL": True, "HAS_BIAS": False, "BLOCK_M": 1,
          "BLOCK_N": 16, "BLOCK_K": 512, "NORM_BLOCK": 4096, "DOT_F32": False,
          "IEEE_DOT": False, "ACCURATE_EXP": True, "PF_LINE": 64, "PF_LINES": lines}, 3),
        ("paged_decode", paged_decode_kernel,
         {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "GROUP": 4, "ROWS": 16, "NUM_SPLITS": 16,
          "FUSED_MERGE": True, "MERGE_ROWS": 4, "BLOCK_N": 64, "HEAD_SIZE": 128, "HEAD_PAD": 128,
          "PAGE_SIZE": 16, "DOT_F32": False, "DOT_IEEE": False, "KV_LINE": 64,
          "KV_LINES": 2 if pdl else 0}, 2),
        ("reduce_splits", reduce_splits_kernel,
         {"NUM_HEADS": 32, "NUM_SPLITS": 16, "BLOCK_N": 64, "HEAD_SIZE": 128,
          "HEAD_PAD": 128}, 1),
        ("rotary_qk", _rotary_qk_kernel,
         {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_SIZE": 128, "HEAD_PAD": 128,
          "ROT": 128, "HEADS": 8, "HAS_NORM": False, "WRITE_CACHE": True,
          "PAGE_SIZE": 16}, 1),
        ("rms_norm", _rms_norm_kernel, {"HAS_RESIDUAL": True, "BLOCK": 4096}, 1),
        ("chunk_argmax", _chunk_argmax_kernel, {"CHUNKS": 32, "BLOCK": 4096}, 1),
        ("rows_argmax", _rows_argmax_kernel, {"CHUNKS": 32, "CHUNKS_PAD": 32}, 1),
        ("rotary_cos_sin", _cos_sin_kernel, {"HALF": 64, "HALF_PAD": 64, "ACCURATE": True}, 1),
        ("silu_and_mul", _silu_and_mul_kernel, {"BLOCK": 1024, "ACCURATE_EXP": True}, 1),
        ("reshape_and_cache", _reshape_and_cache_kernel,
         {"NUM_KV_HEADS": 8, "HEAD_SIZE": 128, "HEAD_PAD": 128, "BLOCK_SIZE": 16,
          "HEADS_PER_PROGRAM": 8}, 1),
    ]


def _compile(name: str, kernel, constants: dict, num_stages: int, pdl: bool) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    constants = {**constants, "USE_PDL": pdl}
    signature = {}
    for param in kernel.params:
        arg = param.name
        if param.is_constexpr or arg in constants:
            signature[arg] = "constexpr"
            constants.setdefault(arg, param.default)
        elif arg.endswith("_ptr"):
            signature[arg] = _POINTER_TYPES.get(arg, "*bf16")
        else:
            signature[arg] = "fp32" if arg in _FLOATS else "i32"
    compiled = triton_compile(ASTSource(kernel, signature, constants),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": num_stages,
                                       "launch_pdl": pdl})
    ptx = compiled.asm["ptx"]
    return {"kernel": name, "pdl": pdl, "wait": ptx.count("griddepcontrol.wait"),
            "launch_dependents": ptx.count("griddepcontrol.launch_dependents"),
            "prefetch": ptx.count("prefetch.global.L2"),
            "launch_pdl": bool(compiled.metadata.launch_pdl)}


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for pdl in (True, False):
        for name, kernel, constants, stages in _variants(pdl):
            print(json.dumps(_compile(name, kernel, constants, stages, pdl)), flush=True)
