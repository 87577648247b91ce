"""SwiGLU in the gate-up projection's epilogue (``glu_out`` of
:func:`lmkit_kernels.gemv.small_m_linear` and of the norm fold; the layers'
:meth:`~lmkit_plugins.models.layers.Linear.forward_glu`), on the CPU in Triton's
interpreter: the same bits as the gate-up projection followed by the separate
SiLU-and-multiply kernel (up to one ulp in the interpreter, whose dot products go through
numpy's shape-dependent OpenBLAS kernels; see ``interpret_mode.assert_ulps_apart``), which layers take it (dense half precision, no tensor
parallelism, SiLU; not with ``LMKIT_GLU_EPILOGUE=0``), and that a tiny Llama's hidden
states are bit-identical with it on and off, at decode sizes and above them."""

from __future__ import annotations

import pytest
from interpret_mode import assert_ulps_apart, require_triton_interpreter
from tiny_prefill import prefill_hidden, tiny_llama

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu")
torch = pytest.importorskip("torch")

from lmkit_kernels.activation import silu_and_mul  # noqa: E402
from lmkit_kernels.gemv import small_m_linear, small_m_linear_ref  # noqa: E402
from lmkit_kernels.gemv_fold import norm_small_m_linear  # noqa: E402
from lmkit_kernels.interpreter import bf16_round_to_nearest  # noqa: E402
from lmkit_plugins.models import fused_ops, layers, llama, llama_layers  # noqa: E402
from lmkit_plugins.models.fused_ops import SMALL_BATCH, GemvFold  # noqa: E402
from lmkit_plugins.models.layers import Linear  # noqa: E402
from lmkit_plugins.models.tensor_parallel import TensorParallel  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def gpu_rounding():
    with bf16_round_to_nearest() as patched:
        yield patched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_small_m_glu_out_is_the_separate_kernels_bit_for_bit(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    # I = 40 with 32-wide tiles: the last program holds 8 real pairs of 16
    for inter, k, block_n in ((48, 64, 16), (40, 96, 32)):
        x = torch.randn(rows, k, generator=g).to(dtype)
        w = (0.2 * torch.randn(2 * inter, k, generator=g)).to(dtype)
        b = torch.randn(2 * inter, generator=g).to(dtype)
        for bias in (None, b):
            want = silu_and_mul(small_m_linear(x, w, bias, block_n=block_n, block_k=32))
            got = small_m_linear(x, w, bias, block_n=block_n, block_k=32, glu_out=True)
            assert got.shape == (rows, inter)
            assert_ulps_apart(got, want)  # (bit for bit on the GPU: tests/gpu)
            torch.testing.assert_close(got.float(), small_m_linear_ref(x, w, bias, glu_out=True)
                                       .float(), rtol=4e-2, atol=4e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_norm_fold_glu_out_is_the_fold_then_silu_bit_for_bit(dtype, rows):
    g = torch.Generator().manual_seed(10 + rows)
    x, r = (torch.randn(rows, 64, generator=g).to(dtype) for _ in range(2))
    gain = (torch.rand(64, generator=g) + 0.5).to(dtype)
    w = (0.2 * torch.randn(96, 64, generator=g)).to(dtype)
    for residual in (None, r):
        y, h = norm_small_m_linear(x, residual, gain, 1e-5, w, block_n=16, block_k=32)
        got, h2 = norm_small_m_linear(x, residual, gain, 1e-5, w, block_n=16, block_k=32,
                                      glu_out=True)
        assert torch.equal(got, silu_and_mul(y)) and torch.equal(h, h2)


def test_an_odd_projection_is_refused():
    x, w = torch.randn(2, 32).half(), torch.randn(33, 32).half()
    with pytest.raises(ValueError, match=r"glu_out needs a \[gate \| up\] weight with an even "
                                         r"number of rows, got 33"):
        small_m_linear(x, w, glu_out=True)
    with pytest.raises(ValueError, match="got 33"):
        norm_small_m_linear(x, None, torch.ones(32).half(), 1e-5, w, glu_out=True)
    with pytest.raises(ValueError, match="two shards of one size, got {'gate': 8, 'up': 9}"):
        Linear(32, {"gate": 8, "up": 9}, bias=False, dtype=torch.float16, device=CPU, glu=True)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused kernels count as enabled on this CPU (interpreted): the seam of
    test_gemv_fold_routing.py."""
    monkeypatch.delenv("LMKIT_GLU_EPILOGUE", raising=False)
    monkeypatch.delenv("LMKIT_GEMV_FOLD", raising=False)
    for module in (fused_ops, layers, llama, llama_layers):
        monkeypatch.setattr(module, "fused_ops_enabled", lambda device, dtype: True)


def test_which_layers_take_the_epilogue(fused_on_cpu, monkeypatch):
    model = tiny_llama()
    assert all(layer.mlp.gate_up_proj.glu for layer in model.model.layers)
    assert not any(layer.mlp.down_proj.glu for layer in model.model.layers)
    dims = model.dims
    tp = TensorParallel(rank=0, size=2, group=None)
    assert not llama_layers.LlamaMLP(dims, torch.bfloat16, CPU, tp).gate_up_proj.glu
    gelu = llama_layers.LlamaMLP(dims, torch.bfloat16, CPU, act=lambda t: t[:, :96])
    assert not gelu.gate_up_proj.glu  # another activation: the layer's own kernel
    x = torch.zeros(SMALL_BATCH, 64, dtype=torch.bfloat16)
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert gate_up.glu_takes(x) and not gate_up.glu_takes(torch.zeros(SMALL_BATCH + 1, 64))
    monkeypatch.setenv("LMKIT_GLU_EPILOGUE", "0")
    assert not any(layer.mlp.gate_up_proj.glu for layer in tiny_llama().model.layers)


def test_without_the_seam_cpu_layers_keep_the_separate_kernel(monkeypatch):
    monkeypatch.delenv("LMKIT_GLU_EPILOGUE", raising=False)
    for dtype in (torch.float32, torch.bfloat16):
        assert not Linear(64, {"gate": 32, "up": 32}, bias=False, dtype=dtype, device=CPU,
                          glu=True).glu


@pytest.mark.parametrize("num_tokens", [1, 4, SMALL_BATCH, SMALL_BATCH + 3])
def test_decode_sizes_take_the_epilogue_and_match_it_off(fused_on_cpu, monkeypatch, num_tokens):
    calls = {"small_m": 0, "fold": 0}
    real_small, real_fold = layers.glu_small_m_linear, GemvFold.norm_linear

    def small(*args):
        calls["small_m"] += 1
        return real_small(*args)

    def fold(self, *args, glu_out=False):
        calls["fold"] += glu_out
        return real_fold(self, *args, glu_out=glu_out)

    monkeypatch.setattr(layers, "glu_small_m_linear", small)
    monkeypatch.setattr(GemvFold, "norm_linear", fold)
    on = prefill_hidden(tiny_llama(), num_tokens, 2)
    # two layers: one row through the norm fold's kernel, 2-8 rows through small_m_linear
    assert calls == {"small_m": 2 if 1 < num_tokens <= SMALL_BATCH else 0,
                     "fold": 2 if num_tokens == 1 else 0}
    monkeypatch.setenv("LMKIT_GLU_EPILOGUE", "0")
    off = prefill_hidden(tiny_llama(), num_tokens, 2)
    assert torch.equal(on, off)


def test_only_launches_of_one_wave_take_the_epilogue(fused_on_cpu, monkeypatch):
    """At most GLU_MAX_PROGRAMS_PER_SM programs per SM (32-wide programs above 2,048
    outputs): SmolLM2's 3,072 gate-up outputs on a 132-SM H200 take it, Qwen3-0.6B's
    6,144 and Llama-3.1-8B's 28,672 do not; without an SM count (the interpreter) every
    size does."""
    assert fused_ops.glu_epilogue(CPU, torch.bfloat16, 28672)
    monkeypatch.setattr(fused_ops, "_sm_count", lambda device: 132)
    limit = fused_ops.GLU_MAX_PROGRAMS_PER_SM * 132 * 32
    assert [fused_ops.glu_epilogue(CPU, torch.bfloat16, n)
            for n in (3072, limit, limit + 2, 6144, 28672)] == [True, True, False, False, False]
    monkeypatch.setenv("LMKIT_GLU_EPILOGUE", "0")
    assert not fused_ops.glu_epilogue(CPU, torch.bfloat16, 3072)
