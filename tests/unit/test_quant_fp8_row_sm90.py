"""The one-row FP8 kernel (:mod:`lmkit_kernels.fp8_gemv`: plain, with the input norm
or SiLU-and-multiply folded in, plain and pipelined) compiled for sm_90 (H100/H200)
without a GPU, with Triton's bundled ``ptxas``, at Llama-3.1-8B's shapes: no register
spills (also for the folds at 16 rows per program), and with PDL the programs prefetch their first weight lines and wait on the
previous kernel (``griddepcontrol.wait``), without PDL neither."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offline_sm90 import bundled_tool, run_offline  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    bundled_tool("ptxas") is None or bundled_tool("cuobjdump") is None,
    reason="Triton's bundled ptxas/cuobjdump are not installed")]

# mode, residual, N, K: Llama-8B's QKV and gate-up (norm; the first layer has no
# residual), down (SiLU), output projection and LM head (plain)
SHAPES = [("norm", True, 6144, 4096), ("norm", False, 28672, 4096),
          ("silu_mul", False, 4096, 14336), ("plain", False, 4096, 4096),
          ("plain", False, 128256, 4096)]
VARIANTS = [[*shape, pipeline, True] for shape in SHAPES for pipeline in (False, True)] + [
    [*shape, False, False] for shape in SHAPES[:3]] + [
    # the folds at 16 rows per program (gemv_row_fold_block_n=16; pipelined, that width
    # spills at block_k 1024 and 4 warps: 255 registers and 280-336 bytes of stack)
    [*shape, False, True, 16] for shape in SHAPES[:3]]


def test_sm90_variants_do_not_spill_and_wait_with_pdl():
    results = run_offline("offline_sm90_fp8.py", VARIANTS)
    assert len(results) == len(VARIANTS)
    for r in results:
        assert r["stack"] == 0, r  # no register spills
        assert r["shared"] <= 4096, r  # tiles in registers: shared memory for the sums only
        pdl = r["use_pdl"]
        assert r["waits"] is pdl and r["launches_dependents"] is pdl, r
        assert r["prefetches"] is pdl, r
        assert r["fma"], r  # the products contract as in the plain kernel
        # the norm's own multiplies are explicit round-to-nearest ones (not contracted)
        assert r["mul_rn"] is (r["mode"] == "norm"), r
