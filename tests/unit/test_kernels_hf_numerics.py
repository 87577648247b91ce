"""The fused layer kernels round exactly where Hugging Face transformers rounds.

transformers' half-precision Llama/Qwen3 layers are chains of torch ops, each rounding
its result to bfloat16/float16: RoPE is ``(x * cos) + (rotate_half(x) * sin)`` (three
roundings), RMSNorm normalises in float32, rounds, then multiplies by the weight and
rounds, the residual add rounds, SiLU rounds before the multiply by ``up``. Each test
feeds the same half-precision inputs to transformers' own functions and to lmkit's
kernel (in Triton's CPU interpreter, made to round bfloat16 to nearest like the GPU:
:mod:`lmkit_kernels.interpreter`) and expects the same bits. Where a float32 sum is
reduced in a different order (the norms' mean square, numpy's versus torch's ``exp``),
a result may sit one unit in the last place away, rarely; those tests bound it.
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu")
pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from lmkit_kernels.activation import silu_and_mul  # noqa: E402
from lmkit_kernels.interpreter import bf16_round_to_nearest  # noqa: E402
from lmkit_kernels.norm import rms_norm  # noqa: E402
from lmkit_kernels.rotary import rotary_qk_  # noqa: E402
from lmkit_plugins.models.rotary import RotaryEmbedding, rope_config_from_hf  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.llama import modeling_llama as hf  # noqa: E402

HALF = [torch.bfloat16, torch.float16]
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


@pytest.fixture(autouse=True)
def gpu_rounding():
    """bfloat16 rounds to nearest even in the interpreter, as on the GPU."""
    with bf16_round_to_nearest() as patched:
        if not patched:
            pytest.skip("this Triton's interpreter cannot be made to round bfloat16 to nearest")
        yield


def _assert_same_bits(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    diff = (actual != expected).sum().item()
    assert diff == 0, f"{diff} of {actual.numel()} elements differ from transformers"


def _assert_same_but_reduction_order(actual, expected):
    """Bit-equal except, at under 1% of the elements, a unit or two in the last place (a
    float32 sum reduced in another order can land on the other side of a rounding, which
    a following op, RoPE after a q/k norm, may carry)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    differ = actual != expected
    assert differ.float().mean().item() < 0.01, f"{int(differ.sum())} elements differ"
    ulp = 2 * ULP[actual.dtype] * expected.float().abs().clamp_min(1.0)
    assert torch.all((actual.float() - expected.float()).abs() <= ulp)


def _hf_rope(head_dim: int, dtype, positions):
    """transformers' cos/sin for ``positions``: ``[1, n, head_dim]`` each, in ``dtype``."""
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         rope_theta=10000.0)
    emb = hf.LlamaRotaryEmbedding(config)
    cos, sin = emb(torch.zeros(1, dtype=dtype), positions[None])
    return config, cos, sin


def _qkv(n, heads, kv_heads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g) * 2).to(dtype)


def _split(qkv, heads, kv_heads, head_dim):
    """HF's layout: ``[1, heads, n, head_dim]`` query and key states."""
    n = qkv.shape[0]
    q = qkv[:, :heads * head_dim].view(1, n, heads, head_dim).transpose(1, 2)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim]
    return q, k.view(1, n, kv_heads, head_dim).transpose(1, 2)


@pytest.mark.parametrize("dtype", HALF)
def test_rope_matches_transformers_bit_for_bit(dtype):
    heads, kv_heads, head_dim = 4, 2, 32
    positions = torch.tensor([0, 1, 7, 100, 999, 4095, 31000])
    config, cos_hf, sin_hf = _hf_rope(head_dim, dtype, positions)
    qkv = _qkv(len(positions), heads, kv_heads, head_dim, dtype, seed=0)
    q_hf, k_hf = hf.apply_rotary_pos_emb(*_split(qkv, heads, kv_heads, head_dim), cos_hf, sin_hf)

    rotary = RotaryEmbedding(rope_config_from_hf(config, head_dim), head_dim, torch.device("cpu"))
    cos, sin = rotary.cos_sin(positions, dtype)
    _assert_same_bits(cos[:, 0], cos_hf[0])
    # the torch path (CPU and float32 models)
    n = len(positions)
    qk = rotary.apply(qkv[:, :(heads + kv_heads) * head_dim].view(n, -1, head_dim), cos, sin)
    _assert_same_bits(qk[:, :heads], q_hf[0].transpose(0, 1))
    _assert_same_bits(qk[:, heads:], k_hf[0].transpose(0, 1))
    # the fused kernel, in place
    out = qkv.clone()
    rotary_qk_(out, cos, sin, num_heads=heads, num_kv_heads=kv_heads, head_size=head_dim)
    q, k = _split(out, heads, kv_heads, head_dim)
    _assert_same_bits(q, q_hf)
    _assert_same_bits(k, k_hf)


@pytest.mark.parametrize("dtype", HALF)
def test_qk_norm_and_rope_match_transformers(dtype):
    """Qwen3: RMSNorm over each query and key head (Qwen3RMSNorm is LlamaRMSNorm), then RoPE."""
    heads, kv_heads, head_dim, eps = 4, 2, 64, 1e-6
    positions = torch.arange(0, 600, 50)
    _, cos_hf, sin_hf = _hf_rope(head_dim, dtype, positions)
    qkv = _qkv(len(positions), heads, kv_heads, head_dim, dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    q_norm, k_norm = hf.LlamaRMSNorm(head_dim, eps), hf.LlamaRMSNorm(head_dim, eps)
    for norm in (q_norm, k_norm):
        norm.weight.data = (1 + 0.3 * torch.randn(head_dim, generator=g))
        norm.to(dtype)
    q, k = _split(qkv, heads, kv_heads, head_dim)
    with torch.no_grad():
        q_hf, k_hf = hf.apply_rotary_pos_emb(q_norm(q), k_norm(k), cos_hf, sin_hf)
    out = qkv.clone()
    rotary_qk_(out, cos_hf[0, :, None], sin_hf[0, :, None] * _rotate_half_sign(head_dim, dtype),
               num_heads=heads, num_kv_heads=kv_heads, head_size=head_dim,
               q_norm=q_norm.weight.data, k_norm=k_norm.weight.data, eps=eps)
    q, k = _split(out, heads, kv_heads, head_dim)
    _assert_same_but_reduction_order(q, q_hf)
    _assert_same_but_reduction_order(k, k_hf)


def _rotate_half_sign(head_dim, dtype):
    """``[-1] * half + [1] * half``: folds rotate_half's sign into ``sin`` (exact)."""
    half = head_dim // 2
    return torch.cat((-torch.ones(half), torch.ones(half))).to(dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_residual_add_and_rms_norm_match_transformers(dtype):
    hidden, eps = 576, 1e-5
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, hidden, generator=g) * 3).to(dtype)
    residual = (torch.randn(9, hidden, generator=g) * 5).to(dtype)
    norm = hf.LlamaRMSNorm(hidden, eps)
    norm.weight.data = 1 + 0.2 * torch.randn(hidden, generator=g)
    norm.to(dtype)
    with torch.no_grad():
        summed = residual + x  # LlamaDecoderLayer: hidden_states = residual + hidden_states
        expected = norm(summed)
    normed, new_residual = rms_norm(x, norm.weight.data, eps, residual)
    _assert_same_bits(new_residual, summed)
    _assert_same_but_reduction_order(normed, expected)


@pytest.mark.parametrize("dtype", HALF)
def test_silu_and_mul_matches_transformers(dtype):
    g = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(2, 6, 1536, generator=g) * 4).to(dtype)
    expected = ACT2FN["silu"](gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    _assert_same_but_reduction_order(silu_and_mul(torch.cat((gate, up), dim=-1)), expected)
