"""Decode attention (:mod:`lmkit_kernels.paged_decode`) and the plain weight-streaming
GEMV (:mod:`lmkit_kernels.gemv`) compiled for sm_90 (H100/H200) without a GPU, with
Triton's bundled ``ptxas``: at the launches the engine makes for Llama-3.1-8B, Qwen3-0.6B,
SmolLM2-135M and a wide query group (batch 1 to 256; the slice merge at once and looped;
the wide and narrow GEMV tiles), every variant fits in shared memory and spills no
registers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offline_sm90 import SM90_MAX_SHARED, bundled_tool, run_offline  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    bundled_tool("ptxas") is None or bundled_tool("cuobjdump") is None,
    reason="Triton's bundled ptxas/cuobjdump are not installed")]

# (num_heads, num_kv_heads, head_size): Llama-8B, Qwen3-0.6B, SmolLM2, a group of 8
HEADS = [(32, 8, 128), (16, 8, 128), (9, 3, 64), (64, 8, 128)]
VARIANTS = [["decode", h, kv, d, reqs, True] for h, kv, d in HEADS for reqs in (1, 4, 64, 256)]
VARIANTS += [["decode", 32, 8, 128, 1, False], ["decode", 16, 8, 128, 64, False]]
VARIANTS += [["gemv", n] for n in (128256, 28672, 6144, 4096, 1024)]


def test_sm90_decode_launches_fit_and_do_not_spill():
    results = run_offline("offline_sm90_decode.py", VARIANTS)
    assert len(results) == len(VARIANTS)
    for r in results:
        assert r["shared"] <= SM90_MAX_SHARED, r
        # no register spills; the 16-wide GEMV program (96 registers) gets an 8-byte stack
        # frame from the bundled sm_90 ptxas, none from its newer ptxas-blackwell, which
        # reports no spill stores for the same PTX
        narrow16 = r["kind"] == "gemv" and r["tiles"]["block_n"] == 16
        assert r["stack"] == 0 or (narrow16 and r["stack"] <= 8), r
    # the launches compiled are the engine's: split at batch 1, unsplit at 256; wide GEMV
    # tiles from 6,144 outputs
    decode = {(r["num_heads"], r["num_reqs"]): r for r in results
              if r["kind"] == "decode" and r["merge_at_once"]}
    assert decode[(32, 1)]["splits"] > 1 and decode[(16, 256)]["splits"] == 1
    # the slice's first K and V tile is prefetched before the PDL wait
    assert decode[(32, 1)]["prefetches"] > 0
    wide = {r["out_features"] for r in results
            if r["kind"] == "gemv" and r["tiles"]["block_n"] == 64}
    assert wide == {128256, 28672, 6144}
