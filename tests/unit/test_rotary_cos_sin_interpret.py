"""The step's RoPE cos/sin rows in one kernel (:mod:`lmkit_kernels.rotary_cos_sin`) under
Triton's CPU interpreter, against the torch ops it replaces (the GPU check, bit for
bit with libdevice's cosf/sinf, is in tests/gpu/test_kernels_gpu.py)."""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu")
torch = pytest.importorskip("torch")

from lmkit_kernels.interpreter import bf16_round_to_nearest  # noqa: E402
from lmkit_kernels.rotary_cos_sin import rotary_cos_sin, rotary_cos_sin_ref  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("half", [64, 24])  # a power of two, and a padded one
def test_rows_match_the_torch_ops(dtype, half):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 2 * half, 2).float() / (2 * half)))
    positions = torch.tensor([0, 1, 7, 300, 4095, 131071], dtype=torch.int64)
    with bf16_round_to_nearest():
        cos, sin = rotary_cos_sin(positions, inv_freq, dtype)
    ref_cos, ref_sin = rotary_cos_sin_ref(positions, inv_freq, dtype)
    assert cos.shape == sin.shape == (6, 1, 2 * half) and cos.dtype == dtype
    # numpy's and torch's CPU cos/sin may differ in the last float32 bit (and so, rarely,
    # in a half-precision rounding)
    tol = {"atol": 1e-6 if dtype == torch.float32 else 1e-2, "rtol": 0}
    assert (cos == ref_cos).float().mean().item() > (0.8 if dtype == torch.float32 else 0.98)
    torch.testing.assert_close(cos, ref_cos, **tol)
    torch.testing.assert_close(sin, ref_sin, **tol)
    assert torch.equal(sin[..., :half], -sin[..., half:])
    assert torch.equal(cos[..., :half], cos[..., half:])


def test_int32_positions_and_an_empty_step():
    inv_freq = torch.rand(8)
    cos, sin = rotary_cos_sin(torch.arange(5, dtype=torch.int32), inv_freq, torch.float32)
    torch.testing.assert_close(cos, rotary_cos_sin_ref(torch.arange(5), inv_freq,
                                                       torch.float32)[0], atol=2e-7, rtol=0)
    cos, sin = rotary_cos_sin(torch.zeros(0, dtype=torch.int64), inv_freq, torch.bfloat16)
    assert cos.shape == (0, 1, 16)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="positions"):
        rotary_cos_sin(torch.arange(4.0), torch.rand(8), torch.float32)
    with pytest.raises(ValueError, match="inv_freq"):
        rotary_cos_sin(torch.arange(4), torch.rand(8, dtype=torch.float64), torch.float32)
