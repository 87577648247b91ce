"""Compile lmkit's folded projection kernel for sm_90 (H100/H200) on a machine without a
GPU, with Triton's bundled ``ptxas``, and report each variant's shared memory,
registers and register spills (``cuobjdump -res-usage``).

Run as a script (Triton must not be in interpreter mode, so the test runs it in a
subprocess): ``python offline_sm90.py '[[rows, fold, has_residual, out_features], ...]'``
prints one JSON object per variant, launched as
:class:`lmkit_plugins.models.fused_ops.GemvFold` launches it
(:meth:`lmkit_plugins.models.fused_ops.GemvFold.tiles`,
:func:`lmkit_kernels.gemv_fold.launch_config`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

SM90_MAX_SHARED = 232448  # bytes of shared memory a program may use on sm_90 (227 KiB)
SM90_SM_SHARED = 233472  # bytes of shared memory per SM (228 KiB; 1 KiB of it per program
#                          is the system's)


def bundled_tool(name: str) -> str | None:
    """The path of Triton's bundled CUDA tool ``name`` (ptxas, cuobjdump), if present."""
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "backends", "nvidia", "bin", name)
    return path if os.access(path, os.X_OK) else None


def run_offline(script: str, variants: list | None = None, timeout: int = 900) -> list[dict]:
    """Run the offline-compile ``script`` (beside this file) in a subprocess without
    Triton's interpreter, with ``variants`` as its JSON argument when given, and return
    the JSON objects it printed, one per line.

    :raises AssertionError: the script failed (its stderr's tail in the message)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), script)]
    if variants is not None:
        args.append(json.dumps(variants))
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def resource_usage(kernel) -> dict[str, str]:
    """``{"REG": registers, "STACK": bytes}`` of a compiled kernel, read from its cubin
    with the bundled ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([bundled_tool("cuobjdump"), "-res-usage", f.name], check=True,
                           capture_output=True, text=True).stdout
    os.unlink(f.name)
    return dict(re.findall(r"(REG|STACK):(\d+)", usage))


def _compile(rows: int, fold: str, has_residual: bool, out_features: int,
             glu_out: bool = False) -> dict:
    from lmkit_kernels.gemv_fold import _fold_linear_kernel, launch_config
    from lmkit_plugins.models.fused_ops import GemvFold
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    tiles = GemvFold.tiles(fold, out_features)
    silu_mul = fold == "silu_mul"
    block_m, block_k, stages = launch_config(rows, silu_mul, has_residual, tiles["block_n"],
                                             tiles["block_k"], tiles["num_stages"], 2,
                                             SM90_MAX_SHARED)
    pointers = ["x_ptr", "res_ptr", "g_ptr", "w_ptr", "b_ptr", "out_ptr", "res_out_ptr"]
    ints = ["M", "N", "K", "stride_xm", "stride_rm", "stride_hm", "stride_wn", "stride_om"]
    constants = {"SILU_MUL": silu_mul, "HAS_RESIDUAL": has_residual, "HAS_BIAS": False,
                 "BLOCK_M": block_m, "BLOCK_N": tiles["block_n"], "BLOCK_K": block_k,
                 "NORM_BLOCK": 4096, "DOT_F32": False, "IEEE_DOT": False, "ACCURATE_EXP": True,
                 # launched with PDL on an H100: the wait and the first slice's prefetch
                 "USE_PDL": True, "PF_LINE": 64, "PF_LINES": block_k // 64,
                 "GLU_OUT": glu_out}
    signature = {**{p: "*bf16" for p in pointers}, **{i: "i32" for i in ints},
                 "inv_k": "fp32", "eps": "fp32", **{c: "constexpr" for c in constants}}
    # what the launch specialises on: 16-byte aligned pointers, sizes divisible by 16
    names = _fold_linear_kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a in pointers + ints if a != "M"}
    kernel = triton_compile(ASTSource(_fold_linear_kernel, signature, constants, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": tiles["num_warps"], "num_stages": stages,
                                     "enable_fp_fusion": False})
    fields = resource_usage(kernel)
    return {"rows": rows, "fold": fold, "has_residual": has_residual, "glu_out": glu_out,
            "out_features": out_features, "block_m": block_m, "block_k": block_k,
            "num_stages": stages, "shared": kernel.metadata.shared,
            "registers": int(fields["REG"]), "stack": int(fields["STACK"])}


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for variant in json.loads(sys.argv[1]):
        print(json.dumps(_compile(*variant)), flush=True)
