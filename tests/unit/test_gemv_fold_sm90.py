"""The folded projection kernel (:mod:`lmkit_kernels.gemv_fold`) compiled for sm_90
(H100/H200) without a GPU, with Triton's bundled ``ptxas``: every variant the Llama
layers launch at Llama-3.1-8B's and Qwen3-0.6B's shapes fits in shared memory with the
stages :func:`~lmkit_kernels.gemv_fold.launch_config` gives it and spills no
registers (16 rows of SiLU over 512-wide slices spilled 3 KiB per thread, 8 rows 0.6 KiB)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offline_sm90 import SM90_MAX_SHARED, SM90_SM_SHARED, bundled_tool, run_offline  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    bundled_tool("ptxas") is None or bundled_tool("cuobjdump") is None,
    reason="Triton's bundled ptxas/cuobjdump are not installed")]

# rows, fold, residual, out_features: QKV / gate-up (norm; the first layer has no
# residual) and down (SiLU), one row and several; 1024 outputs take 16-wide programs;
# the gate-up projection with SwiGLU in its epilogue (glu_out, one row: Llama-8B's and
# SmolLM2's)
VARIANTS = [[rows, fold, res, n] for rows in (1, 2, 8, 16)
            for fold, res, n in (("norm", True, 6144), ("norm", False, 28672),
                                 ("silu_mul", False, 4096), ("silu_mul", False, 1024))]
VARIANTS += [[1, "norm", True, 28672, True], [1, "norm", True, 3072, True]]


def test_sm90_variants_fit_and_do_not_spill():
    results = run_offline("offline_sm90.py", VARIANTS, timeout=600)
    assert len(results) == len(VARIANTS)
    for r in results:
        assert r["shared"] <= SM90_MAX_SHARED, r
        assert r["stack"] == 0, r  # no register spills
    # the pipelines keep their depth: 512-wide slices over 4 stages (3 for the norm), or
    # for 8 and 16 rows of SiLU narrower slices over more stages (the same weight bytes
    # in flight)
    assert {(r["fold"], r["block_k"], r["num_stages"]) for r in results} == {
        ("norm", 512, 3), ("silu_mul", 512, 4), ("silu_mul", 256, 7), ("silu_mul", 128, 13)}
    # at one row two programs of the norm fold share an SM (one's prologue overlaps the
    # other's weight stream)
    for r in results:
        if r["fold"] == "norm" and r["rows"] == 1:
            assert 2 * (r["shared"] + 1024) <= SM90_SM_SHARED, r
