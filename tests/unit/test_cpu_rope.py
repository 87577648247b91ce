"""The C in-place RoPE kernel (CPU decode) against :meth:`RotaryEmbedding.apply`, bit for
bit: the same products and sums, each rounded as torch rounds them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from lmkit_kernels.cpu.rope import (  # noqa: E402
    MAX_ROWS,
    rope_inplace,
    rope_kernel,
    rope_unavailable_reason,
)
from lmkit_plugins.models.rotary import (  # noqa: E402
    RopeConfig,
    RotaryEmbedding,
    cpu_rope_kernel,
)

CPU = torch.device("cpu")


@pytest.fixture
def kernel():
    if rope_kernel() is None:
        pytest.skip(f"C RoPE kernel not available: {rope_unavailable_reason()}")


def _rotary(head_dim: int, partial: float = 1.0) -> RotaryEmbedding:
    return RotaryEmbedding(RopeConfig(10000.0, "default", {}, int(head_dim * partial)),
                           head_dim, CPU)


@pytest.mark.parametrize("m", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (2, 1, 32)])
def test_in_place_rotation_is_apply_bit_for_bit(kernel, m, heads, kv_heads, head_dim):
    # a fused QKV output: q and k heads rotated, v heads left alone, rows strided
    rotary = _rotary(head_dim)
    gen = torch.Generator().manual_seed(m + heads)
    qkv = torch.randn(m, (heads + 2 * kv_heads) * head_dim, generator=gen) * 4
    positions = torch.randint(0, 5000, (m,), generator=gen)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    all_heads = qkv.view(m, -1, head_dim)
    expected = rotary.apply(all_heads[:, :heads + kv_heads], cos, sin)
    v_before = all_heads[:, heads + kv_heads:].clone()
    rope_inplace(all_heads, cos, sin, heads + kv_heads)
    assert torch.equal(all_heads[:, :heads + kv_heads], expected)
    assert torch.equal(all_heads[:, heads + kv_heads:], v_before)


def test_rows_of_a_wider_tensor(kernel):
    rotary = _rotary(64)
    wide = torch.randn(4, 3 * 64 + 10)
    x = wide[:, :3 * 64].view(4, 3, 64)  # row stride 202 floats
    cos, sin = rotary.cos_sin(torch.tensor([0, 7, 100, 2047]), torch.float32)
    expected = rotary.apply(x, cos, sin)
    tail = wide[:, 192:].clone()
    rope_inplace(x, cos, sin)
    assert torch.equal(x, expected) and torch.equal(wide[:, 192:], tail)


def test_refuses_what_it_does_not_take(kernel):
    rotary = _rotary(64)
    cos, sin = rotary.cos_sin(torch.tensor([1]), torch.float32)
    with pytest.raises(ValueError, match="heads must be contiguous"):
        rope_inplace(torch.randn(1, 64, 3).transpose(1, 2), cos, sin)
    with pytest.raises(ValueError, match="m <= 32"):
        rope_inplace(torch.randn(MAX_ROWS + 1, 2, 64), cos, sin)
    with pytest.raises(ValueError, match="cos must be a contiguous"):
        rope_inplace(torch.randn(2, 2, 64), cos, sin)
    with pytest.raises(ValueError, match="num_heads=3"):
        rope_inplace(torch.randn(1, 2, 64), cos, sin, 3)
    with pytest.raises(ValueError, match="float32 CPU"):
        rope_inplace(torch.randn(1, 2, 64, dtype=torch.float64), cos, sin)


def test_layers_use_it_only_for_float32_whole_head_rotation(kernel):
    assert cpu_rope_kernel(_rotary(64), CPU, torch.float32) is not None
    assert cpu_rope_kernel(_rotary(64, partial=0.5), CPU, torch.float32) is None
    assert cpu_rope_kernel(_rotary(64), CPU, torch.bfloat16) is None
