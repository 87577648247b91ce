"""The one-row FP8 kernel's folds and pipelined variant in Triton's CPU interpreter
(:mod:`lmkit_kernels.fp8_gemv_fold`, :func:`lmkit_kernels.fp8_gemv.fp8_row_linear` with
``pipeline``): bit for bit the separate kernels (:func:`lmkit_kernels.norm.rms_norm`,
:func:`lmkit_kernels.activation.silu_and_mul`, then the plain one-row kernel with the
same tiles), with the interpreter's bfloat16 / e4m3 conversions rounded as the GPU
rounds (:func:`lmkit_kernels.interpreter.fp8_round_to_nearest`)."""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter()
torch = pytest.importorskip("torch")

from lmkit_kernels.activation import silu_and_mul  # noqa: E402
from lmkit_kernels.fp8 import quantize_per_channel  # noqa: E402
from lmkit_kernels.fp8_gemv import fp8_row_linear  # noqa: E402
from lmkit_kernels.fp8_gemv_fold import (  # noqa: E402
    norm_fp8_row_linear,
    norm_fp8_row_linear_ref,
    silu_mul_fp8_row_linear,
    silu_mul_fp8_row_linear_ref,
)
from lmkit_kernels.norm import rms_norm  # noqa: E402

# (N, K, block_n, block_k): partial programs (N not a multiple of block_n), K tails
# (K not a multiple of block_k), one slice and several
SHAPES = [(70, 200, 8, 64), (33, 96, 16, 32), (24, 64, 8, 128), (9, 300, 4, 256)]


pytestmark = pytest.mark.usefixtures("fp8_gpu_rounding")


def _weight(n, k, g):
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]
    return quantize_per_channel(w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "block_n", "block_k"), SHAPES)
def test_pipelined_kernel_is_the_plain_one(dtype, n, k, block_n, block_k):
    g = torch.Generator().manual_seed(n * k)
    q, scale = _weight(n, k, g)
    x = torch.randn(1, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    for bias in (None, b):
        tiles = {"block_n": block_n, "block_k": block_k}
        plain = fp8_row_linear(x, q, scale, bias, **tiles)
        assert torch.equal(fp8_row_linear(x, q, scale, bias, pipeline=True, **tiles), plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "block_n", "block_k"), SHAPES)
@pytest.mark.parametrize("pipeline", [False, True])
def test_norm_fold_is_the_separate_kernels(dtype, n, k, block_n, block_k, pipeline):
    g = torch.Generator().manual_seed(n + k)
    q, scale = _weight(n, k, g)
    x = (3 * torch.randn(1, k, generator=g)).to(dtype)
    res = torch.randn(1, k, generator=g).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    tiles = {"block_n": block_n, "block_k": block_k}
    for residual in (None, res):
        for bias in (None, b):
            out, h = norm_fp8_row_linear(x, residual, norm_w, 1e-5, q, scale, bias,
                                         pipeline=pipeline, **tiles)
            if residual is None:
                normed, want_h = rms_norm(x, norm_w, 1e-5), x
                assert h is x
            else:
                normed, want_h = rms_norm(x, norm_w, 1e-5, residual)
            assert torch.equal(h, want_h)
            assert torch.equal(out, fp8_row_linear(normed, q, scale, bias, **tiles))
            ref, ref_h = norm_fp8_row_linear_ref(x, residual, norm_w, 1e-5, q, scale, bias)
            assert torch.equal(h, ref_h)
            assert (out.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "block_n", "block_k"), SHAPES)
@pytest.mark.parametrize("pipeline", [False, True])
def test_silu_mul_fold_is_the_separate_kernels(dtype, n, k, block_n, block_k, pipeline):
    g = torch.Generator().manual_seed(n - k)
    q, scale = _weight(n, k, g)
    gate_up = (2 * torch.randn(1, 2 * k, generator=g)).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    tiles = {"block_n": block_n, "block_k": block_k}
    for bias in (None, b):
        out = silu_mul_fp8_row_linear(gate_up, q, scale, bias, pipeline=pipeline, **tiles)
        assert torch.equal(out, fp8_row_linear(silu_and_mul(gate_up), q, scale, bias, **tiles))
        ref = silu_mul_fp8_row_linear_ref(gate_up, q, scale, bias)
        assert (out.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()


def test_a_long_row_takes_several_norm_slices():
    # K over the prologue's 8192-element slice: the sum of squares runs in two slices
    g = torch.Generator().manual_seed(1)
    q, scale = _weight(8, 9000, g)
    x, res = (torch.randn(1, 9000, generator=g).bfloat16() for _ in range(2))
    norm_w = torch.ones(9000, dtype=torch.bfloat16)
    out, h = norm_fp8_row_linear(x, res, norm_w, 1e-6, q, scale, block_n=8, block_k=1024)
    ref, ref_h = norm_fp8_row_linear_ref(x, res, norm_w, 1e-6, q, scale)
    assert torch.equal(h, ref_h)
    assert (out.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()


def test_the_folds_refuse_what_they_cannot_run():
    q, scale = quantize_per_channel(torch.randn(32, 64))
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    norm_w = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="norm_fp8_row_linear takes one row, got 2"):
        norm_fp8_row_linear(torch.randn(2, 64, dtype=torch.bfloat16), None, norm_w, 1e-5,
                            q, scale)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \[64\]"):
        norm_fp8_row_linear(x, None, norm_w[:32], 1e-5, q, scale)
    with pytest.raises(ValueError, match=r"residual must have shape \[1, 64\]"):
        norm_fp8_row_linear(x, torch.randn(1, 32, dtype=torch.bfloat16), norm_w, 1e-5, q,
                            scale)
    with pytest.raises(ValueError, match="x has dtype float32"):
        norm_fp8_row_linear(x.float(), None, norm_w.float(), 1e-5, q, scale)
    with pytest.raises(ValueError, match="even last dimension"):
        silu_mul_fp8_row_linear(torch.randn(1, 129, dtype=torch.bfloat16), q, scale)
    with pytest.raises(ValueError, match=r"weight must have shape \[\*, 32\]|weight must have"):
        silu_mul_fp8_row_linear(x, q, scale)  # gate_up [1, 64]: I = 32, weight K = 64
    with pytest.raises(ValueError, match="silu_mul_fp8_row_linear takes one row, got 3"):
        silu_mul_fp8_row_linear(torch.randn(3, 128, dtype=torch.bfloat16), q, scale)
