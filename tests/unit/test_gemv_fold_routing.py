"""Where the Llama family's layers fold RMSNorm / SiLU-and-multiply into the small-batch
projection (:class:`lmkit_plugins.models.fused_ops.GemvFold`), on the CPU.

The fold is for dense CUDA half-precision layers; here the device check is stubbed
through the same seam the other fused-kernel tests use (``fused_ops_enabled`` in the
model modules), so the layers run lmkit's Triton kernels in the interpreter. Checked:
which layers fold (not float32, not CPU, not quantized, not under tensor
parallelism, not around a non-dense MLP, not with ``LMKIT_GEMV_FOLD=0``), that inputs
of at most ``FOLD_MAX_ROWS`` rows take the folded kernels and larger ones the separate
kernels, and that a tiny Llama's hidden states are bit-identical with the fold on and
off.
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter
from tiny_prefill import prefill_hidden, tiny_llama

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu")
torch = pytest.importorskip("torch")

from lmkit_kernels.interpreter import bf16_round_to_nearest  # noqa: E402
from lmkit_plugins.models import fused_ops, layers, llama, llama_layers  # noqa: E402
from lmkit_plugins.models.fused_ops import (  # noqa: E402
    FOLD_MAX_ROWS,
    SMALL_BATCH,
    GemvFold,
    gemv_fold,
)
from lmkit_plugins.models.layers import Linear  # noqa: E402
from lmkit_plugins.models.tensor_parallel import TensorParallel  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def gpu_rounding():
    with bf16_round_to_nearest() as patched:
        yield patched


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The seam: the fused kernels count as enabled on this CPU (run interpreted); both
    folds on (``LMKIT_GEMV_FOLD=1``; unset keeps only the norm fold)."""
    monkeypatch.setenv("LMKIT_GEMV_FOLD", "1")
    for module in (fused_ops, layers, llama, llama_layers):
        monkeypatch.setattr(module, "fused_ops_enabled", lambda device, dtype: True)


def _tiny_llama(seed=0):
    return tiny_llama(seed)


def _run(model, num_tokens):
    return prefill_hidden(model, num_tokens, 2)


def test_the_switch_and_the_device_decide():
    # no CUDA device is touched: the decision reads the device type and the dtype
    cuda = torch.device("cuda")
    if fused_ops.fused_ops_enabled(cuda, torch.bfloat16):  # triton installed
        assert isinstance(gemv_fold(cuda, torch.bfloat16, "norm"), GemvFold)
    assert gemv_fold(cuda, torch.float32, "norm") is None
    assert gemv_fold(CPU, torch.bfloat16, "silu_mul") is None


def _folded(model):
    """(norm folded, SiLU folded) over the model's layers: each all or none, else None."""
    norm = {layer._norm_folded for layer in model.model.layers}
    silu = {layer.mlp._silu_folded for layer in model.model.layers}
    return (norm.pop() if len(norm) == 1 else None, silu.pop() if len(silu) == 1 else None)


def test_env_switch_turns_folds_off(fused_on_cpu, monkeypatch):
    assert isinstance(gemv_fold(CPU, torch.bfloat16, "norm"), GemvFold)
    assert _folded(_tiny_llama()) == (True, True)
    monkeypatch.delenv("LMKIT_GEMV_FOLD")  # the default: the norm fold only
    assert _folded(_tiny_llama()) == (True, False)
    assert gemv_fold(CPU, torch.bfloat16, "silu_mul") is None
    for value, expected in (("0", (False, False)), ("off", (False, False)),
                            ("False", (False, False)), ("1", (True, True)),
                            ("norm", (True, False)), ("silu_mul", (False, True)),
                            ("silu_mul, norm", (True, True))):
        monkeypatch.setenv("LMKIT_GEMV_FOLD", value)
        assert _folded(_tiny_llama()) == expected, value
    monkeypatch.setenv("LMKIT_GEMV_FOLD", "norm,silu")
    with pytest.raises(ValueError, match="unknown fold silu; expected 1 .all., 0 .none. or "
                                         "a comma-separated subset of norm, silu_mul"):
        gemv_fold(CPU, torch.bfloat16, "norm")


class _Method:
    """As much of a quantization method as building a Linear reads."""

    fold_max_rows = 32


def test_which_layers_fold(fused_on_cpu):
    kw = {"dtype": torch.bfloat16, "device": CPU}
    assert Linear(64, {"weight": 32}, bias=False, fold="norm", **kw).gemv_fold is not None
    assert Linear(64, {"weight": 32}, bias=False, fold="silu_mul", quantization=_Method(),
                  **kw).gemv_fold is None  # quantized weights: the method's own kernels
    assert Linear(64, {"weight": 32}, bias=False, **kw).gemv_fold is None  # nothing to fold
    model = _tiny_llama()
    dims = model.dims
    tp = TensorParallel(rank=0, size=2, group=None)
    sharded = llama_layers.LlamaDecoderLayer(dims, 0, model.rotary, torch.bfloat16, CPU, tp)
    assert not sharded._norm_folded and not sharded.mlp._silu_folded
    other_mlp = llama_layers.LlamaDecoderLayer(dims, 0, model.rotary, torch.bfloat16, CPU,
                                               mlp=torch.nn.Identity())
    assert not other_mlp._norm_folded
    gelu = llama_layers.LlamaMLP(dims, torch.bfloat16, CPU, act=lambda t: t[:, :96])
    assert not gelu._silu_folded


def test_without_the_seam_cpu_layers_do_not_fold(monkeypatch):
    monkeypatch.delenv("LMKIT_GEMV_FOLD", raising=False)
    for dtype in (torch.float32, torch.bfloat16):
        assert Linear(64, {"weight": 32}, bias=False, fold="norm", dtype=dtype,
                      device=CPU).gemv_fold is None


def _count_calls(monkeypatch):
    calls = {"norm_linear": 0, "silu_mul_linear": 0}
    for name in calls:
        real = getattr(GemvFold, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(GemvFold, name, spy)
    return calls


@pytest.mark.parametrize("num_tokens", [1, FOLD_MAX_ROWS + 1, SMALL_BATCH, SMALL_BATCH + 3])
def test_small_inputs_take_the_fold_and_match_the_separate_kernels(fused_on_cpu, monkeypatch,
                                                                    num_tokens):
    monkeypatch.setenv("LMKIT_GLU_EPILOGUE", "0")  # else SiLU runs in the gate-up kernel
    calls = _count_calls(monkeypatch)
    folded = _run(_tiny_llama(), num_tokens)
    small = num_tokens <= FOLD_MAX_ROWS
    assert calls == {"norm_linear": 4 if small else 0, "silu_mul_linear": 2 if small else 0}
    monkeypatch.setenv("LMKIT_GEMV_FOLD", "0")
    unfolded = _run(_tiny_llama(), num_tokens)
    assert calls["norm_linear"] == (4 if small else 0)  # no more calls with the fold off
    assert torch.equal(folded, unfolded)


def test_a_replaced_input_norm_is_never_folded(fused_on_cpu, monkeypatch):
    """An EAGLE-1/2 head's first layer has no input norm (its own identity module): with
    the folds on, its one-row QKV projection must not fold an RMSNorm in (nor read the
    replacement's weight), and the layer computes what it computes unfolded."""

    class Identity(torch.nn.Module):
        def forward(self, x):
            return x

    model = _tiny_llama()
    layer = model.model.layers[0]
    assert layer._norm_folded
    layer.replace_input_norm(Identity())
    assert not layer._norm_folded
    folded_out = _run(model, 1)  # later layers still fold
    monkeypatch.setenv("LMKIT_GEMV_FOLD", "0")
    unfolded = _tiny_llama()
    assert _folded(unfolded) == (False, False)
    unfolded.model.layers[0].replace_input_norm(Identity())
    torch.testing.assert_close(folded_out, _run(unfolded, 1), rtol=0, atol=0)


def test_wide_tiles_for_plain_projections_only(fused_on_cpu, monkeypatch):
    """From WIDE_TILES_MIN_OUT outputs a plain small-batch projection (an LM head, a
    gate-up without the SwiGLU epilogue) streams 64-row, 8-warp programs over 256-wide
    slices; smaller ones, the folds and ``LMKIT_GEMV_WIDE_TILES=0`` keep the narrow
    tiles. The linear layer launches with exactly those tiles, and both compute the
    product (over four 256-wide slices or two 512-wide ones)."""
    wide = {"block_n": 64, "block_k": 256, "num_warps": 8, "num_stages": 3}
    n = fused_ops.WIDE_TILES_MIN_OUT
    assert fused_ops.small_m_tiles(n) == wide == fused_ops.small_m_tiles(151936)
    assert fused_ops.small_m_tiles(n - 1) == fused_ops.narrow_tiles(n - 1)
    assert fused_ops.narrow_tiles(n)["block_n"] == 32
    assert fused_ops.narrow_tiles(2048)["block_n"] == 16
    assert GemvFold.tiles("norm", 28672) == {**fused_ops.narrow_tiles(28672),
                                             "num_stages": fused_ops.NORM_FOLD_STAGES}
    assert GemvFold.tiles("silu_mul", 28672) == fused_ops.narrow_tiles(28672)

    launched = []
    import lmkit_kernels.gemv as gemv

    real = gemv.small_m_linear

    def spy(x, weight, bias=None, **tiles):
        launched.append(tiles)
        return real(x, weight, bias, **tiles)

    monkeypatch.setattr(gemv, "small_m_linear", spy)
    linear = fused_ops.linear_kernel(CPU, torch.bfloat16, lambda *a: None)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1024, generator=g).to(torch.bfloat16)
    weight = (torch.randn(n, 1024, generator=g) * 0.03).to(torch.bfloat16)
    out_wide = linear(x, weight, None)
    monkeypatch.setenv(fused_ops.WIDE_TILES_ENV, "0")
    assert fused_ops.small_m_tiles(n) == fused_ops.narrow_tiles(n)
    out_narrow = linear(x, weight, None)
    assert launched == [wide, fused_ops.narrow_tiles(n)]
    reference = gemv.small_m_linear_ref(x, weight)
    torch.testing.assert_close(out_wide, reference)
    torch.testing.assert_close(out_narrow, reference)
