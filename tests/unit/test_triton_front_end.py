"""Every compiled variant of the sampling and penalty kernels, and of the paged prefill
attention kernel (its draft-tree variant included), gets through Triton's front end
(Python AST -> Triton IR for an sm_90 target) on the CPU.

The interpreter (``TRITON_INTERPRET=1``) runs kernels as Python, so it misses what only
the compiler refuses -- a name bound in one constexpr branch and read outside it, a
type that differs between an ``if``'s branches. Session 30's multi-program top-p search
passed every interpreter test and failed to compile on the GPU (``p`` bound only when
``HAS_TOP_P``); this catches that without a GPU. The check runs in a subprocess
without ``TRITON_INTERPRET`` (the tests' conftest sets it, and interpreted modules
cannot be compiled). Pointer and integer argument types come from the parameter names:
the front end only needs them plausible.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

FLAG_PREFIXES = ("HAS_", "FIRST", "NOISE", "DOT_", "KV_FP8")
INT64_POINTERS = ("arg", "idx", "state", "k_part", "lo_key", "seeds", "out", "top_k", "rows",
                  "slots")
TYPED_POINTERS = {"seen_ptr": "*u8", "counts_ptr": "*i32", "draft_ptr": "*i32",
                  "done_ptr": "*i32"}
CONSTANTS = {"CHUNKS_PAD": 256, "BLOCK_V": 1024, "BLOCK": 1024, "NT": 16}
#: per module: argument types the names do not tell, and its other constexprs' values
MODULE_TYPES = {
    "lmkit_kernels.paged_prefill": {
        "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
        "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
        "tree_region_ptr": "*i32", "tree_mask_ptr": "*i64", "scale_log2": "fp32",
        "v_scale": "fp32"},
}
MODULE_CONSTANTS = {
    "lmkit_kernels.paged_prefill": {
        "GROUP": 4, "GROUP_PAD": 4, "BLOCK_Q": 16, "BLOCK_M": 64, "BLOCK_N": 64,
        "HEAD_SIZE": 128, "HEAD_PAD": 128, "PAGE_SIZE": 16},
}


def _signature(fn, constexprs: dict, types: dict[str, str]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        elif name.endswith("_ptr"):
            sig[name] = TYPED_POINTERS.get(
                name, "*i64" if any(t in name for t in INT64_POINTERS) else "*fp32")
        else:
            sig[name] = "i64" if name.startswith("stride") else "i32"
    return sig


def check(module_name: str) -> list[str]:
    """Compile the front end of every variant of ``module_name``'s ``*kernel``s (each
    combination of its boolean constexpr flags); the failures, one line each."""
    import importlib

    import triton
    from triton._C import libtriton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({})
    context = libtriton.ir.context()
    libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(options)
    module_map = backend.get_module_map()
    module = importlib.import_module(module_name)
    failures, count = [], 0
    for name in sorted(dir(module)):
        fn = getattr(module, name)
        if not (isinstance(fn, triton.runtime.jit.JITFunction) and name.endswith("kernel")):
            continue
        flags = [a for a in fn.arg_names if a.startswith(FLAG_PREFIXES)]
        constants = {**CONSTANTS, **MODULE_CONSTANTS.get(module_name, {})}
        for values in itertools.product([False, True], repeat=len(flags)):
            consts = {k: v for k, v in {**constants, **dict(zip(flags, values, strict=True))}.items()
                      if k in fn.arg_names}
            src = ASTSource(fn, _signature(fn, consts, MODULE_TYPES.get(module_name, {})),
                            constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
            try:
                src.make_ir(target, options, codegen, module_map, context)
                count += 1
            except Exception as e:  # noqa: BLE001 (reported to the test)
                failures.append(f"{name} {consts}: {str(e).splitlines()[-1]}")
    if count < 2:
        failures.append(f"only {count} variants of {module_name} compiled")
    return failures


@pytest.mark.parametrize("module_name", ["lmkit_kernels.sampling_kernels",
                                         "lmkit_kernels.sampling_race",
                                         "lmkit_kernels.penalties",
                                         "lmkit_kernels.paged_prefill"])
def test_every_variant_compiles_its_front_end(module_name):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, module_name], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


if __name__ == "__main__":
    problems = check(sys.argv[1])
    print("\n".join(problems))
    sys.exit(1 if problems else 0)
