"""Which CPU projection kernel a dtype gets when oneDNN cannot run it on this CPU.

oneDNN's bfloat16 linear kernel and its residual-add post-op need AVX-512 (or
AVX-NE-CONVERT); on an AVX2-only CPU they raise, so bfloat16 projections must fall back
to ``F.linear`` instead of failing in the model's first step.
"""

import pytest
import torch
import torch.nn.functional as F
from lmkit_plugins.models import cpu_linear


@pytest.fixture
def fresh_probe():
    cpu_linear._onednn_works.cache_clear()
    yield
    cpu_linear._onednn_works.cache_clear()


def _raise(*args, **kwargs):
    raise RuntimeError("could not create a primitive descriptor")


def test_a_dtype_whose_onednn_linear_raises_falls_back_to_f_linear(monkeypatch, fresh_probe):
    monkeypatch.setattr(cpu_linear, "_linear_pointwise", _raise)
    assert not cpu_linear._onednn_works(torch.bfloat16)
    assert cpu_linear.cpu_linear_kernel("cpu", torch.bfloat16) is F.linear


def test_a_dtype_whose_add_post_op_raises_falls_back_to_f_linear(monkeypatch, fresh_probe):
    if not cpu_linear._onednn_works(torch.float32):
        pytest.skip("this torch build runs no oneDNN linear kernel")
    cpu_linear._onednn_works.cache_clear()
    monkeypatch.setattr(cpu_linear, "_linear_binary", _raise)
    assert not cpu_linear._onednn_works(torch.float32)
    assert cpu_linear.cpu_linear_kernel("cpu", torch.float32) is F.linear


def test_the_probe_is_per_dtype(monkeypatch, fresh_probe):
    calls = []
    real = cpu_linear._onednn_linear

    def recording(x, w, b):
        calls.append(x.dtype)
        return real(x, w, b)

    monkeypatch.setattr(cpu_linear, "_onednn_linear", recording)
    cpu_linear._onednn_works(torch.float32)
    cpu_linear._onednn_works(torch.bfloat16)
    assert calls == [torch.float32, torch.bfloat16]


def test_bfloat16_projections_run_on_this_cpu():
    """Whatever kernel the probe picks, a bfloat16 projection runs and matches float32."""
    kernel = cpu_linear.cpu_linear_kernel("cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(32, generator=g)
    got = kernel(x.bfloat16(), w.bfloat16(), b.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x, w, b), atol=0.5, rtol=0.05)
