"""The C residual-add + RMSNorm kernel (CPU decode) against Hugging Face's formula."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from lmkit_kernels.cpu.rms_norm import (  # noqa: E402
    MAX_ROWS,
    add_rms_norm,
    rms_norm_kernel,
    rms_norm_unavailable_reason,
)

CPU = torch.device("cpu")


@pytest.fixture
def kernel():
    if rms_norm_kernel() is None:
        pytest.skip(f"C RMSNorm kernel not available: {rms_norm_unavailable_reason()}")


def hf_rms_norm(h, weight, eps):
    variance = h.pow(2).mean(-1, keepdim=True)
    return weight * (h * torch.rsqrt(variance + eps))


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n", [576, 1024, 37, 5])
def test_matches_the_hf_formula(kernel, m, n):
    g = torch.Generator().manual_seed(m * 100 + n)
    x, r = torch.randn(m, n, generator=g) * 3, torch.randn(m, n, generator=g)
    w = torch.randn(n, generator=g)
    torch.testing.assert_close(add_rms_norm(x, w, 1e-5), hf_rms_norm(x, w, 1e-5),
                               rtol=2e-6, atol=2e-6)
    normed, summed = add_rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(summed, x + r)  # the new residual stream, exactly
    torch.testing.assert_close(normed, hf_rms_norm(x + r, w, 1e-6), rtol=2e-6, atol=2e-6)


def test_strided_rows(kernel):
    g = torch.Generator().manual_seed(1)
    mem = torch.randn(3, 700, generator=g)
    x, r, w = mem[:, :576], mem[:, 100:676], torch.randn(576, generator=g)
    normed, summed = add_rms_norm(x, w, 1e-5, residual=r)
    assert torch.equal(summed, x + r)
    torch.testing.assert_close(normed, hf_rms_norm(x + r, w, 1e-5), rtol=2e-6, atol=2e-6)


def test_refuses_what_it_does_not_take(kernel):
    w = torch.ones(8)
    with pytest.raises(ValueError, match="takes"):
        add_rms_norm(torch.ones(MAX_ROWS + 1, 8), w, 1e-5)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        add_rms_norm(torch.ones(1, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="float32"):
        add_rms_norm(torch.ones(1, 8, dtype=torch.float64), w, 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.ones(1, 8), w, 1e-5, residual=torch.ones(2, 8))


def test_the_model_norm_uses_it_for_decode_rows_and_torch_beyond(kernel, monkeypatch):
    from lmkit_plugins.models.layers import RMSNorm

    norm = RMSNorm(64, 1e-6, dtype=torch.float32, device=CPU)
    assert norm._cpu_rows is not None
    norm.weight.copy_(torch.randn(64))
    x, r = torch.randn(MAX_ROWS + 2, 64), torch.randn(MAX_ROWS + 2, 64)
    with torch.inference_mode():
        small, small_sum = norm.forward(x[:MAX_ROWS], r[:MAX_ROWS])
        big, big_sum = norm.forward(x, r)
        assert torch.equal(small_sum, big_sum[:MAX_ROWS])
        torch.testing.assert_close(small, big[:MAX_ROWS], rtol=2e-6, atol=2e-6)
        calls = []
        monkeypatch.setattr(norm, "_cpu_rows", lambda *a: calls.append(a) or a[0])
        norm.forward(x[:1])
        norm.forward(x)
        assert len(calls) == 1  # only the decode-sized input
    assert RMSNorm(64, 1e-6, dtype=torch.bfloat16, device=CPU)._cpu_rows is None
