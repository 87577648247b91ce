"""The CPU decode fast paths compute exactly what the plain formulas compute.

Single-stream decode on the CPU is bound by per-op overhead around the weight reads, so
the torch path takes shortcuts: RoPE cos/sin rows come from a table, RoPE swaps halves
with one ``flip``, SiLU-and-multiply slices instead of ``chunk``, and float32
projections without the C row-GEMV kernel keep their weights as transposed views of
``[in, out]`` memory (oneDNN's faster layout; the tests here turn the C kernel off to
check that path, tests/unit/test_cpu_row_gemv.py checks the kernel). Each must leave
the numbers alone (or, for one-row projections, within float32 rounding of the plain
product).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from lmkit_plugins.models.layers import (  # noqa: E402
    Linear,
    _onednn_linear,
    cpu_linear_kernel,
    cpu_weight_row_length,
    silu_and_mul,
)
from lmkit_plugins.models.rotary import RopeConfig, RotaryEmbedding  # noqa: E402

CPU = torch.device("cpu")


def _rotary(head_dim: int, partial: float = 1.0, theta: float = 10000.0) -> RotaryEmbedding:
    return RotaryEmbedding(RopeConfig(theta, "default", {}, int(head_dim * partial)), head_dim,
                           CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,partial", [(64, 1.0), (128, 1.0), (64, 0.5)])
def test_cos_sin_table_rows_equal_the_direct_computation(dtype, head_dim, partial):
    rotary = _rotary(head_dim, partial)
    g = torch.Generator().manual_seed(0)
    sizes = []
    for _ in range(40):  # growing and shrinking batches, positions anywhere below 9000
        n = int(torch.randint(1, 33, (1,), generator=g))
        positions = torch.randint(0, 9000, (n,), generator=g)
        cos, sin = rotary.cos_sin(positions, dtype)
        ref_cos, ref_sin = rotary._compute_cos_sin(positions, dtype)
        assert cos.shape == ref_cos.shape == (n, 1, int(head_dim * partial))
        assert cos.dtype == sin.dtype == dtype
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
        sizes.append(rotary._cpu_tables[dtype].shape[1])
    assert sizes == sorted(sizes) and sizes[-1] >= 9000  # grown on demand, never shrunk


def test_cos_sin_table_grows_for_a_later_longer_context():
    rotary = _rotary(64)
    rotary.cos_sin(torch.tensor([3]), torch.float32)
    small = rotary._cpu_tables[torch.float32].shape[1]
    far = torch.tensor([small + 1000, 5])
    cos, sin = rotary.cos_sin(far, torch.float32)
    ref_cos, ref_sin = rotary._compute_cos_sin(far, torch.float32)
    assert rotary._cpu_tables[torch.float32].shape[1] > small + 1000
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_apply_equals_rotate_half_formula(dtype):
    """``(x * cos) + (rotate_half(x) * sin)``, each op rounded, as transformers computes it,
    on a strided view of a fused QKV output."""
    heads, head_dim, n = 12, 64, 5
    rotary = _rotary(head_dim)
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(n, (heads + 3) * head_dim, generator=g) * 3).to(dtype)
    x = qkv[:, :heads * head_dim].view(n, heads, head_dim)
    cos, sin = rotary.cos_sin(torch.tensor([0, 1, 17, 300, 4000]), dtype)
    half = head_dim // 2
    rotate_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    sin_plain = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # undo the folded sign
    expected = (x * cos) + (rotate_half * sin_plain)
    got = rotary.apply(x, cos, sin)
    assert got.shape == (n, heads, head_dim) and got.is_contiguous()
    assert torch.equal(got, expected)


def test_silu_and_mul_equals_silu_of_gate_times_up():
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(3, 2 * 1536, generator=g)
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate_up[:, :1536]) * gate_up[:, 1536:])


@pytest.fixture
def no_row_gemv(monkeypatch):
    """The layers as built on a machine where the C row-GEMV kernel is not available."""
    import lmkit_plugins.models.cpu_linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "_row_gemv", lambda: None)


def _onednn_or_skip():
    kernel = cpu_linear_kernel(CPU, torch.float32)
    if kernel is not _onednn_linear:
        pytest.skip("this torch build has no oneDNN linear kernel")
    return kernel


def test_weight_row_length_rule(no_row_gemv):
    onednn = _onednn_or_skip()
    assert cpu_weight_row_length(onednn, torch.float32, 960) == 960  # SmolLM2 QKV
    assert cpu_weight_row_length(onednn, torch.float32, 576) == 576  # o_proj, down_proj
    assert cpu_weight_row_length(onednn, torch.float32, 3072) == 3104  # off 2 KiB multiples
    assert cpu_weight_row_length(onednn, torch.bfloat16, 960) is None  # float32 only
    assert cpu_weight_row_length(F.linear, torch.float32, 960) is None  # oneDNN only


def _loaded_linear(out_parts: dict[str, int], in_features: int, seed: int):
    lin = Linear(in_features, out_parts, bias=True, dtype=torch.float32, device=CPU)
    g = torch.Generator().manual_seed(seed)
    parts = {name: (torch.randn(size, in_features, generator=g) * 0.05,
                    torch.randn(size, generator=g)) for name, size in out_parts.items()}
    for name, (w, b) in parts.items():
        lin.load_shard(name, weight=w, bias=b)
    weight = torch.cat([w for w, _ in parts.values()])
    bias = torch.cat([b for _, b in parts.values()])
    return lin, weight, bias


@pytest.mark.parametrize("parts,row", [({"q": 576, "k": 192, "v": 192}, 960),
                                       ({"gate": 1536, "up": 1536}, 3104)])
def test_linear_in_transposed_memory_loads_and_computes_the_same_product(parts, row, no_row_gemv):
    _onednn_or_skip()
    lin, weight, bias = _loaded_linear(parts, 576, seed=3)
    out = sum(parts.values())
    assert lin.weight.shape == (out, 576) and lin.weight.stride() == (1, row)
    assert torch.equal(lin.weight, weight) and torch.equal(lin.bias, bias)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 576, generator=g)
    plain = _onednn_linear(x, weight.contiguous(), bias)  # the [out, in] layout
    with torch.inference_mode():
        got = lin.forward(x)
        # more than one row: the same kernel either way, bit for bit
        assert got.shape == (16, out) and torch.equal(got, plain)
        # one row (decode at batch 1): another kernel, within float32 rounding
        torch.testing.assert_close(lin.forward(x[:1]), x[:1] @ weight.T + bias,
                                   rtol=1e-5, atol=1e-5)


def test_silu_and_mul_of_a_padded_projection_output(no_row_gemv):
    _onednn_or_skip()
    lin, weight, _ = _loaded_linear({"gate": 1536, "up": 1536}, 576, seed=5)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        gate_up = lin.forward(x)
        assert gate_up.stride(0) == 3104  # a view of the padded product
        assert torch.equal(silu_and_mul(gate_up), silu_and_mul(gate_up.contiguous()))


@pytest.mark.parametrize("vocab", [1000, 1024])  # 1024: padded to keep rows off 2 KiB
def test_vocab_embedding_in_transposed_memory_looks_up_and_scores_the_same(vocab, no_row_gemv):
    from lmkit_plugins.models.layers import VocabEmbedding

    _onednn_or_skip()
    emb = VocabEmbedding(vocab, 64, dtype=torch.float32, device=CPU)
    table = torch.randn(vocab, 64, generator=torch.Generator().manual_seed(7))
    emb.weight.copy_(table)  # how the model loader fills it
    assert not emb.weight.is_contiguous() and torch.equal(emb.weight, table)
    ids = torch.tensor([0, 5, vocab - 1, 5])
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        assert torch.equal(emb(ids), table[ids])
        logits = emb.logits(hidden)
        assert logits.shape == (3, vocab) and logits.is_contiguous()
        assert torch.equal(logits, _onednn_linear(hidden, table, None))
        torch.testing.assert_close(emb.logits(hidden[:1]), hidden[:1] @ table.T,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 8])
def test_decode_only_steps_plan_one_group_and_match_dense_attention(window):
    from test_torch_attention import PagedWorld, make_backend

    backend = make_backend(6, 2, 64, 16, sliding_window=window)
    world = PagedWorld(backend, num_blocks=128)
    world.prefill_cached(0, 37)
    world.prefill_cached(1, 5)
    world.step([(2, 9)])
    for work in ([(0, 1), (1, 1), (2, 1)], [(1, 1)], [(2, 1), (0, 1)]):
        world.step(work)  # against dense causal attention
        plan = backend._plan
        assert plan.covers_all and len(plan.groups) == 1
        group = plan.groups[0]
        assert group.max_query_len == 1 and group.query_rows == slice(0, len(work))
        # unequal contexts or a window need the mask; one request without a window does not
        assert (group.mask is None) == (len(work) == 1 and window is None)
