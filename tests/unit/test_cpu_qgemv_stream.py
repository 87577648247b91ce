"""The quantized GEMV's weight stream: the built library really prefetches, and the
AVX-512 build's Q4 high nibbles (multiplied in place, 16 times the weight, and the
block's integer sum shifted right by 4) give exactly the AVX2 build's results at the
extremes of the integer ranges (every nibble 15, activations at +-127)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

torch = pytest.importorskip("torch")
from lmkit_kernels.cpu import qgemv  # noqa: E402
from lmkit_kernels.cpu.build import compile_library  # noqa: E402
from lmkit_kernels.cpu.qgemv import (  # noqa: E402
    BLOCK_BYTES,
    QTYPES,
    pack_weight,
    qgemv_isa,
    qgemv_unavailable_reason,
    qgemv_variants,
    reference_dequantize,
)


def test_the_built_library_prefetches_the_weight_stream():
    # GCC 12 once dropped _mm_prefetch from the target("avx512...") loops without a
    # word; the stream then ran at about 60% of the core's read rate
    if not qgemv_isa():
        pytest.skip(qgemv_unavailable_reason())
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not installed")
    listing = subprocess.run([objdump, "-d", str(compile_library(qgemv.SOURCE))],
                             capture_output=True, text=True, check=True).stdout
    functions = listing.split("\n\n")  # objdump separates functions by a blank line
    # the VNNI loops (vpdpbusd) prefetch themselves, not only the AVX2 build
    assert any("vpdpbusd" in f and "prefetcht1" in f for f in functions)
    assert any("vpdpbusd" not in f and "vpmaddubsw" in f and "prefetcht1" in f
               for f in functions)


def _extreme_blocks(qtype: int, n: int, k: int) -> torch.Tensor:
    """Blocks whose quantized values sit at the ends of their ranges (nibbles 15 or 0,
    int8 127 or -128, mixed per row) with scale 1 (and min -8 for Q4_1)."""
    nb, size = k // 32, BLOCK_BYTES[qtype]
    raw = torch.zeros(n, nb, size, dtype=torch.uint8)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    raw[..., 0:2] = one
    start = 2
    if qtype == QTYPES["Q4_1"]:
        raw[..., 2:4] = torch.tensor([-8.0], dtype=torch.float16).view(torch.uint8)
        start = 4
    fill = torch.arange(n * nb).reshape(n, nb, 1) % 3  # 0: max, 1: min, 2: alternating
    hi = 0xFF if qtype != QTYPES["Q8_0"] else 0x7F
    lo = 0x00 if qtype != QTYPES["Q8_0"] else 0x80
    alt = torch.tensor([hi, lo], dtype=torch.uint8).repeat((size - start) // 2 + 1)[:size - start]
    raw[..., start:] = torch.where(fill == 0, hi, torch.where(fill == 1, lo, alt))
    return raw.reshape(n, nb * size)


@pytest.mark.parametrize("qname", sorted(QTYPES))
@pytest.mark.parametrize("k", [32, 576, 1536])
def test_builds_agree_at_the_ends_of_the_integer_ranges(qname, k):
    found = qgemv_variants()
    if not found:
        pytest.skip(qgemv_unavailable_reason())
    qtype = QTYPES[qname]
    raw = _extreme_blocks(qtype, 40, k)
    # activations quantizing to +-127 within every block (max |x| equal in each block)
    x = torch.tensor([1.0, -1.0]).repeat(3, k // 2)
    x[1] = -x[1]
    x[2, ::3] = 64 / 127  # quantizes to 64 exactly
    w = pack_weight(qtype, raw, k)
    ref = x @ reference_dequantize(qtype, raw, k).t()
    outs = {isa: fn(x, w, None) for isa, fn in found.items()}
    for out in outs.values():
        # scale-1 blocks and x exactly representable in int8 steps of 1/127: the only
        # error is float32 rounding of the block sums
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-3)
    first = next(iter(outs.values()))
    assert all(torch.equal(first, o) for o in outs.values())
