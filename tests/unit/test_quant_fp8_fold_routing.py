"""Where the Llama family's layers with FP8 weights fold RMSNorm / SiLU-and-multiply
into the one-row FP8 kernel (:class:`lmkit_plugins.quantization.fp8_cuda.Fp8Linear`'s
``norm_linear`` / ``silu_mul_linear``, through the quantization contract's
``linear_with_norm`` / ``linear_with_silu_mul``), on the CPU.

The method and the fused kernels run on CUDA; here the device checks are stubbed
through seams (``runs_kernels`` and ``fused_ops_enabled`` in the FP8 method,
``fused_ops_enabled`` in the model modules), so the layers run lmkit's Triton kernels
in the interpreter with the GPU's bfloat16 / e4m3 rounding. Checked: one-row inputs
take the folded kernels and several rows the separate ones, with bit-identical hidden
states and logits either way; which layers fold (not under tensor parallelism, not
around a non-dense MLP, not after ``replace_input_norm``, not with ``LMKIT_GEMV_FOLD=0``
or ``LMKIT_FUSED_OPS=0``); and the LM head quantized with ``quantize_lm_head`` takes
the one-row kernel at one row.
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter
from tiny_prefill import prefill_hidden

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import lmkit_kernels.fp8_gemv as fp8_gemv  # noqa: E402
import lmkit_kernels.fp8_gemv_fold as fp8_gemv_fold  # noqa: E402
from lmkit.api import ModelBuildContext  # noqa: E402
from lmkit_kernels.fp8 import quantize_per_channel  # noqa: E402
from lmkit_plugins.attention.triton_backend import TritonAttention  # noqa: E402
from lmkit_plugins.models import fused_ops, layers, llama, llama_layers  # noqa: E402
from lmkit_plugins.models.tensor_parallel import TensorParallel  # noqa: E402
from lmkit_plugins.quantization import fp8_cuda  # noqa: E402
from lmkit_plugins.quantization.fp8_checkpoint import Fp8Weight, quantized  # noqa: E402
from lmkit_plugins.quantization.fp8_cuda import Fp8Method  # noqa: E402
from lmkit_plugins.quantization.fp8_options import Fp8Options  # noqa: E402

CPU = torch.device("cpu")
LAYERS = 2


pytestmark = pytest.mark.usefixtures("fp8_gpu_rounding")


@pytest.fixture
def cuda_on_cpu(monkeypatch):
    """The seams: FP8 weights on this CPU run the Triton kernels, and the fused kernels
    count as enabled (all run interpreted); both folds on (``LMKIT_GEMV_FOLD=1``; unset
    keeps only the norm fold)."""
    monkeypatch.setenv("LMKIT_GEMV_FOLD", "1")
    monkeypatch.delenv("LMKIT_FUSED_OPS", raising=False)
    for module in (fused_ops, layers, llama, llama_layers, fp8_cuda):
        monkeypatch.setattr(module, "fused_ops_enabled", lambda device, dtype: True)
    monkeypatch.setattr(fp8_cuda, "runs_kernels", lambda weight: True)


@pytest.fixture
def calls(monkeypatch):
    """Counts of the one-row kernels' calls: ``plain`` (with the weight's shape), ``norm``,
    ``silu_mul``."""
    seen: dict[str, list] = {"plain": [], "norm": [], "silu_mul": []}
    # (module, function, its weight argument's position, what to count it as)
    for module, name, at, key in ((fp8_gemv, "fp8_row_linear", 1, "plain"),
                                  (fp8_gemv_fold, "norm_fp8_row_linear", 4, "norm"),
                                  (fp8_gemv_fold, "silu_mul_fp8_row_linear", 1, "silu_mul")):
        def spy(*args, _fn=getattr(module, name), _at=at, _key=key, **kw):
            seen[_key].append(tuple(args[_at].shape))
            return _fn(*args, **kw)
        monkeypatch.setattr(module, name, spy)
    return seen


def _method(**options) -> Fp8Method:
    method = Fp8Method.__new__(Fp8Method)  # the device check reads no model facts
    method.facts, method.opts, method.options = None, Fp8Options(**options), None
    method.device = CPU
    return method


def _config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**{"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
                          "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 16,
                          "tie_word_embeddings": False, **kw})


def _weights(seed=0):
    """HF-named weights of the tiny Llama: projections and the LM head as FP8."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (64, 64), "model.norm.weight": (64,),
              "lm_head.weight": (64, 64)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (64,),
                       p + "post_attention_layernorm.weight": (64,),
                       p + "self_attn.q_proj.weight": (64, 64),
                       p + "self_attn.k_proj.weight": (32, 64),
                       p + "self_attn.v_proj.weight": (32, 64),
                       p + "self_attn.o_proj.weight": (64, 64),
                       p + "mlp.gate_proj.weight": (96, 64), p + "mlp.up_proj.weight": (96, 64),
                       p + "mlp.down_proj.weight": (64, 96)})
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = (1 + 0.1 * torch.randn(shape, generator=g)).bfloat16()
        elif "proj" in name or name == "lm_head.weight":
            out[name] = quantized(Fp8Weight(*quantize_per_channel(
                0.3 * torch.randn(shape, generator=g))))
        else:
            out[name] = (0.5 * torch.randn(shape, generator=g)).bfloat16()
    return out


def _model(method=None, **config):
    ctx = ModelBuildContext(dtype=torch.bfloat16, device=CPU, block_size=4,
                            attention_cls=TritonAttention,
                            quantization=method or _method())
    model = llama.LlamaForCausalLM(_config(**config), ctx)
    model.load_weights(_weights().items())
    return model


def _run(model, num_tokens):
    hidden = prefill_hidden(model, num_tokens, LAYERS)
    with torch.inference_mode():
        return hidden, model.compute_logits(hidden[-1:])


def _folded(model):
    return ({layer._norm_folded for layer in model.model.layers},
            {layer.mlp._silu_folded for layer in model.model.layers})


def test_one_row_folds_and_matches_the_separate_kernels(cuda_on_cpu, calls, monkeypatch):
    model = _model()
    assert _folded(model) == ({True}, {True})
    hidden, logits = _run(model, 1)
    # both norms of every layer into QKV / gate-up, SiLU into down; o_proj and the LM
    # head through the plain one-row kernel
    assert calls["norm"] == [(128, 64), (192, 64)] * LAYERS
    assert calls["silu_mul"] == [(64, 96)] * LAYERS
    assert calls["plain"] == [(64, 64)] * LAYERS + [(64, 64)]
    for key in calls:
        calls[key].clear()
    hidden3, logits3 = _run(model, 3)  # three rows: the separate kernels
    assert not calls["norm"] and not calls["silu_mul"] and calls["plain"] == [(64, 64)]
    monkeypatch.setenv("LMKIT_GEMV_FOLD", "0")
    separate = _model()
    assert _folded(separate) == ({True}, {True})  # routed, but the method gives no fold
    assert all(layer.self_attn.qkv_proj._qnorm is None for layer in separate.model.layers)
    for key in calls:
        calls[key].clear()
    want, want_logits = _run(separate, 1)
    assert not calls["norm"] and not calls["silu_mul"]
    assert len(calls["plain"]) == 4 * LAYERS + 1  # every projection and the LM head
    assert torch.equal(hidden, want) and torch.equal(logits, want_logits)
    want3, want_logits3 = _run(separate, 3)
    assert torch.equal(hidden3, want3) and torch.equal(logits3, want_logits3)
    assert torch.equal(hidden3[:1], want[:1])  # (causal: the first token alone)


def test_pipelined_and_wider_folds_give_the_same_results(cuda_on_cpu, monkeypatch):
    hidden, logits = _run(_model(), 1)
    piped, piped_logits = _run(_model(_method(gemv_row_pipeline=True)), 1)
    assert torch.equal(hidden, piped) and torch.equal(logits, piped_logits)
    launches = []
    for name in ("norm_fp8_row_linear", "silu_mul_fp8_row_linear"):
        def spy(*args, _fn=getattr(fp8_gemv_fold, name), **kw):
            launches.append((kw["block_n"], kw["block_k"], kw["pipeline"]))
            return _fn(*args, **kw)
        monkeypatch.setattr(fp8_gemv_fold, name, spy)
    wide = _model(_method(gemv_row_fold_block_n=16, gemv_row_tiles=(8, 32, 4)))
    wide_hidden, wide_logits = _run(wide, 1)
    # the folds at 16 rows per program, the K slice (the sum order) of gemv_row_tiles
    assert set(launches) == {(16, 32, False)} and len(launches) == 3 * LAYERS
    narrow_hidden, narrow_logits = _run(_model(_method(gemv_row_tiles=(8, 32, 4))), 1)
    assert torch.equal(wide_hidden, narrow_hidden) and torch.equal(wide_logits, narrow_logits)


def test_the_switches(cuda_on_cpu, monkeypatch):
    w = quantized(Fp8Weight(*quantize_per_channel(torch.randn(32, 64))))
    method = _method()
    assert method.linear_with_norm(w)[1] is not None
    assert method.linear_with_silu_mul(w)[1] is not None
    monkeypatch.delenv("LMKIT_GEMV_FOLD")  # the default: the norm fold only
    assert method.linear_with_norm(w)[1] is not None
    assert method.linear_with_silu_mul(w)[1] is None
    monkeypatch.setenv("LMKIT_GEMV_FOLD", "norm")
    assert method.linear_with_norm(w)[1] is not None
    assert method.linear_with_silu_mul(w)[1] is None
    monkeypatch.setenv("LMKIT_GEMV_FOLD", "0")
    assert method.linear_with_norm(w)[1] is None
    monkeypatch.setenv("LMKIT_GEMV_FOLD", "1")
    assert _method(gemv_row_kernel=False).linear_with_norm(w)[1] is None  # tiled GEMV
    monkeypatch.setattr(fp8_cuda, "fused_ops_enabled", lambda device, dtype: False)
    assert method.linear_with_silu_mul(w)[1] is None  # LMKIT_FUSED_OPS=0, or not CUDA


def test_cpu_weights_give_no_fold():
    w = quantized(Fp8Weight(*quantize_per_channel(torch.randn(32, 64))))
    assert _method().linear_with_norm(w)[1] is None
    assert _method().linear_with_silu_mul(w)[1] is None


def test_which_layers_fold(cuda_on_cpu):
    model = _model()
    dims, quant = model.dims, _method()
    tp = TensorParallel(rank=0, size=2, group=None)
    sharded = llama_layers.LlamaDecoderLayer(dims, 0, model.rotary, torch.bfloat16, CPU, tp,
                                             quant)
    assert not sharded._norm_folded and not sharded.mlp._silu_folded
    other_mlp = llama_layers.LlamaDecoderLayer(dims, 0, model.rotary, torch.bfloat16, CPU,
                                               quant=quant, mlp=torch.nn.Identity())
    assert not other_mlp._norm_folded
    gelu = llama_layers.LlamaMLP(dims, torch.bfloat16, CPU, quant=quant,
                                 act=lambda t: t[:, :96])
    assert not gelu._silu_folded
    eagle = llama_layers.LlamaDecoderLayer(dims, 0, model.rotary, torch.bfloat16, CPU,
                                           quant=quant)
    eagle.replace_input_norm(torch.nn.Identity())
    assert not eagle._norm_folded


def test_the_quantized_lm_head_takes_the_one_row_kernel(cuda_on_cpu, calls):
    model = _model()
    hidden = torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        model.compute_logits(hidden[:1])
        assert calls["plain"] == [(64, 64)]
        model.compute_logits(hidden)  # three rows: the tiled GEMV
    assert calls["plain"] == [(64, 64)]
