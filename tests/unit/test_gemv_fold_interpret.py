"""The folded small-batch projections (:mod:`lmkit_kernels.gemv_fold`) against the
separate kernels they replace, in Triton's CPU interpreter at small shapes.

Half precision is compared bit for bit with RMSNorm / SiLU-and-multiply followed by
``small_m_linear`` (the interpreter sums the norm's squares in the same order for
rows of at most 8192 elements); float32, which ``small_m_linear`` does not take, with
the norm / SiLU kernel followed by a float32 matmul. The compiled kernels are compared
at Llama-3.1-8B's shapes in tests/gpu/test_gemv_fold_gpu.py.
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu")
torch = pytest.importorskip("torch")

from lmkit_kernels.activation import silu_and_mul  # noqa: E402
from lmkit_kernels.gemv import small_m_linear, small_m_linear_ref  # noqa: E402
from lmkit_kernels.gemv_fold import (  # noqa: E402
    norm_small_m_linear,
    norm_small_m_linear_ref,
    silu_mul_small_m_linear,
    silu_mul_small_m_linear_ref,
)
from lmkit_kernels.interpreter import bf16_round_to_nearest  # noqa: E402
from lmkit_kernels.norm import rms_norm  # noqa: E402

BLOCKS = {"block_n": 16, "block_k": 64}  # K = 200 below: not a multiple of BLOCK_K


@pytest.fixture(autouse=True)
def gpu_rounding():
    """bfloat16 rounds to nearest even in the interpreter, as on the GPU."""
    with bf16_round_to_nearest() as patched:
        yield patched


def _linear(x, weight, bias):
    """The projection the unfused path runs on the transformed rows."""
    if x.dtype == torch.float32:
        return small_m_linear_ref(x, weight, bias)
    return small_m_linear(x, weight, bias, **BLOCKS)


def _same(actual, expected):
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()


def _inputs(rows, k, n, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed + rows)
    x = (2 * torch.randn(rows, k, generator=g)).to(dtype)
    weight = (0.1 * torch.randn(n, k, generator=g)).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return g, x, weight, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize(("with_residual", "bias"), [(False, False), (True, True),
                                                     (True, False)])
def test_norm_fold_matches_norm_then_linear(dtype, rows, with_residual, bias):
    g, x, weight, b = _inputs(rows, 200, 40, dtype, bias)
    norm_weight = (1 + 0.1 * torch.randn(200, generator=g)).to(dtype)
    residual = torch.randn(rows, 200, generator=g).to(dtype) if with_residual else None
    x_before = x.clone()
    out, h = norm_small_m_linear(x, residual, norm_weight, 1e-5, weight, b, **BLOCKS)
    if residual is None:
        normed, expected_h = rms_norm(x, norm_weight, 1e-5), x
        assert h is x
    else:
        normed, expected_h = rms_norm(x, norm_weight, 1e-5, residual)
    assert torch.equal(h, expected_h)
    _same(out, _linear(normed, weight, b))
    assert torch.equal(x, x_before)
    ref, ref_h = norm_small_m_linear_ref(x, residual, norm_weight, 1e-5, weight, b)
    assert torch.equal(h, ref_h)
    torch.testing.assert_close(out.float(), ref.float(), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 9, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_fold_matches_silu_then_linear(dtype, rows, bias):
    g, _, weight, b = _inputs(rows, 200, 24, dtype, bias, seed=7)
    gate_up = (3 * torch.randn(rows, 400, generator=g)).to(dtype)
    out = silu_mul_small_m_linear(gate_up, weight, b, **BLOCKS)
    _same(out, _linear(silu_and_mul(gate_up), weight, b))
    torch.testing.assert_close(out.float(), silu_mul_small_m_linear_ref(gate_up, weight, b)
                               .float(), atol=0.1, rtol=0.05)


def test_folds_take_strided_rows_and_long_rows():
    # rows further apart than K (a view of a wider buffer), and K above the prologue's
    # 8192-element slice (the sum of squares then adds two slices: compare within 1 ulp)
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 300, generator=g).to(torch.bfloat16)
    x, residual = wide[:, :136], wide[:, 150:286]
    norm_weight = torch.rand(136, generator=g).to(torch.bfloat16)
    weight = (0.1 * torch.randn(20, 136, generator=g)).to(torch.bfloat16)
    out, h = norm_small_m_linear(x, residual, norm_weight, 1e-6, weight, **BLOCKS)
    normed, expected_h = rms_norm(x, norm_weight, 1e-6, residual)
    assert torch.equal(h, expected_h) and torch.equal(out, _linear(normed, weight, None))
    x = torch.randn(2, 8200, generator=g).to(torch.bfloat16)
    norm_weight = torch.ones(8200, dtype=torch.bfloat16)
    weight = (0.01 * torch.randn(16, 8200, generator=g)).to(torch.bfloat16)
    out, _ = norm_small_m_linear(x, None, norm_weight, 1e-6, weight, block_n=16, block_k=1024)
    ref = small_m_linear(rms_norm(x, norm_weight, 1e-6), weight, block_n=16, block_k=1024)
    torch.testing.assert_close(out.float(), ref.float(), atol=2 ** -7, rtol=2 ** -7)


def test_empty_batch():
    weight = torch.randn(16, 32).to(torch.bfloat16)
    x = torch.empty(0, 32, dtype=torch.bfloat16)
    out, h = norm_small_m_linear(x, x, torch.ones(32, dtype=torch.bfloat16), 1e-6, weight)
    assert out.shape == (0, 16) and h.shape == (0, 32)
    assert silu_mul_small_m_linear(torch.empty(0, 64, dtype=torch.bfloat16),
                                   weight).shape == (0, 16)


def test_launch_config():
    from lmkit_kernels.gemv_fold import SILU_TILE, launch_config

    # the transform runs on the rows rounded up to a power of two, over the slice asked
    # for; the interpreter has no shared memory limit
    assert launch_config(1, True, False, 32, 512, 4, 2, None) == (1, 512, 4)
    assert launch_config(3, True, False, 32, 512, 4, 2, None) == (4, 512, 4)
    assert launch_config(5, False, True, 32, 512, 4, 2, None) == (8, 512, 4)
    # 8 or 16 rows of SiLU: narrower slices, as many more stages as keep the weight bytes
    assert SILU_TILE == 2048
    assert launch_config(5, True, False, 32, 512, 4, 2, None) == (8, 256, 7)
    assert launch_config(16, True, False, 32, 512, 4, 2, None) == (16, 128, 13)
    # shared memory: (stages - 1) stages of the weight and input tiles, plus a scratch tile
    stage = (32 + 2 * 8 + 1) * 512 * 2
    assert launch_config(5, False, True, 32, 512, 4, 2, 3 * stage + 16 * 512 * 2) == (8, 512, 4)
    assert launch_config(5, False, True, 32, 512, 4, 2, 3 * stage + 16 * 512 * 2 - 1) == (
        8, 512, 3)
    assert launch_config(5, False, True, 32, 512, 4, 2, 1000)[2] == 1


def test_launchers_reject_bad_arguments():
    bf = torch.bfloat16
    x, w = torch.randn(2, 32).to(bf), torch.randn(8, 32).to(bf)
    ones = torch.ones(32, dtype=bf)
    with pytest.raises(ValueError, match="at most 16 rows"):
        norm_small_m_linear(torch.randn(17, 32).to(bf), None, ones, 1e-6, w)
    with pytest.raises(ValueError, match="residual must have shape"):
        norm_small_m_linear(x, torch.randn(3, 32).to(bf), ones, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        norm_small_m_linear(x, None, torch.ones(31, dtype=bf), 1e-6, w)
    with pytest.raises(ValueError, match="weight has dtype float32"):
        norm_small_m_linear(x, None, ones, 1e-6, w.float())
    with pytest.raises(ValueError, match="even last dimension"):
        silu_mul_small_m_linear(torch.randn(2, 63).to(bf), w)
    with pytest.raises(ValueError, match="weight must have shape"):
        silu_mul_small_m_linear(torch.randn(2, 128).to(bf), w)


def test_a_launch_out_of_shared_memory_retries_with_fewer_stages(monkeypatch):
    # a GPU whose shared memory holds two stages of this variant: the launcher learns it
    from lmkit_kernels import gemv_fold
    from triton.runtime.errors import OutOfResources

    stages_tried = []

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, num_stages, **kwargs):
                stages_tried.append(num_stages)
                if num_stages > 2:
                    raise OutOfResources(num_stages * 65536, 2 * 65536, "shared memory")
            return launch

    monkeypatch.setattr(gemv_fold, "_fold_linear_kernel", Kernel())
    monkeypatch.setattr(gemv_fold, "_STAGES_THAT_FIT", {})
    x, w = torch.randn(3, 32).to(torch.bfloat16), torch.randn(16, 32).to(torch.bfloat16)
    silu_mul_small_m_linear(torch.cat([x, x], 1), w, block_k=64, num_stages=4)
    silu_mul_small_m_linear(torch.cat([x, x], 1), w, block_k=64, num_stages=4)
    assert stages_tried == [4, 3, 2, 2]
    stages_tried.clear()
    norm_small_m_linear(x, None, torch.ones(32, dtype=torch.bfloat16), 1e-6, w, num_stages=4)
    assert stages_tried == [4, 3, 2]  # another variant: learned on its own
    monkeypatch.setattr(gemv_fold, "_STAGES_THAT_FIT", {})

    class NeverFits(Kernel):
        def __getitem__(self, grid):
            def launch(*args, num_stages, **kwargs):
                raise OutOfResources(1, 0, "shared memory")
            return launch

    monkeypatch.setattr(gemv_fold, "_fold_linear_kernel", NeverFits())
    with pytest.raises(OutOfResources):
        silu_mul_small_m_linear(torch.cat([x, x], 1), w, block_k=64, num_stages=2)
