"""The ``gguf`` method on k-quant files: a tiny random Llama written as a Q4_K_M-style
GGUF (Q4_K projections and embedding, Q6_K down projections and LM head, one layer's
value projection in Q6_K beside Q4_K query/key as llama.cpp's Q4_K_M mixes them, F32
norms) decodes the same greedy tokens as the float32 model transformers dequantizes from
the same file; the C decode-stack executor takes k-quant layers (a mixed-type QKV too) bit
for bit; truncated and wrong-size k-quant tensors are refused before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
from lmkit.api import ModelLoadError, QuantizedTensor  # noqa: E402
from lmkit_kernels.cpu.kquants import KQTYPES, quantize_k, random_kblocks  # noqa: E402
from lmkit_kernels.cpu.qgemv import qgemv_isa, qgemv_unavailable_reason  # noqa: E402
from lmkit_plugins.quantization.gguf_file import open_checked  # noqa: E402
from test_cpu_decode_stack import _Driver, _pair, _shape, needs_executor  # noqa: E402
from test_model_sources import write_tiny_llama_gguf  # noqa: E402
from test_quant_gguf_file import _patch_tensor_info, _write  # noqa: E402

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not qgemv_isa(), reason=qgemv_unavailable_reason() or "-")


def _q4_k_m(name: str, data: np.ndarray) -> tuple[np.ndarray, Q]:
    """Q4_K_M's choice, simplified: Q6_K for the down projections, the LM head and layer
    0's value projection, Q4_K for the rest."""
    kind = "Q6_K" if ("ffn_down" in name or name == "output.weight"
                      or name == "blk.0.attn_v.weight") else "Q4_K"
    return quantize_k(KQTYPES[kind], torch.from_numpy(data)).numpy(), Q[kind]


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kquants") / "tiny-q4_k_m.gguf"
    write_tiny_llama_gguf(path, hidden=256, inter=512, encode=_q4_k_m)
    return path


def test_a_q4_k_m_style_file_passes_the_checks(kquant_gguf):
    types = {Q(t.tensor_type).name for t in open_checked(kquant_gguf).tensors}
    assert types == {"Q4_K", "Q6_K", "F32"}


@pytest.mark.slow
def test_greedy_tokens_equal_the_dequantized_float32_model(kquant_gguf, tmp_path, monkeypatch):
    """Equal up to the first step where the float32 model's two best tokens nearly tie
    (a random tiny model has many: there the Q8_K rounding of the activations, about
    0.1 nats of a logit here, may pick the other one), over at least a third of them."""
    from lmkit import SamplingParams
    from lmkit.frontend.llm import LLM

    monkeypatch.setenv("LMKIT_CACHE", str(tmp_path))
    prompts = ["abcd", "hello", "ab cd ef", "jihgf"]
    runs = {}
    for quantization in ("gguf", "none"):
        llm = LLM(model=str(kquant_gguf), quantization=quantization)
        assert llm.engine.stack.names()["quantization"] == (
            None if quantization == "none" else "gguf")
        runs[quantization] = llm.generate(prompts, SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
        llm.shutdown()
    compared = 0
    for quant, dense in zip(runs["gguf"], runs["none"], strict=True):
        for got, want in zip(quant.outputs[0].token_ids, dense.outputs[0].logprobs, strict=True):
            (_, best), (_, second) = want.top[:2]
            if best - second < 0.2:  # a near-tie: the paths may part from here
                break
            assert got == want.token_id, (quant.prompt, compared)
            compared += 1
    assert compared >= 16, compared  # of 48


def _kquant_weights(model, seed: int = 0, flip: tuple[str, ...] = ()):
    """Random k-quant checkpoint tensors: Q4_K and Q6_K by layer and projection (fused
    parts share a type, except layer 1's projections named in ``flip``), norms dense."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name in sorted(model._weight_targets()):
        if name.endswith("norm.weight"):
            out.append((name, torch.rand(model.dims.hidden_size, generator=gen) + 0.5))
            continue
        n, k = _shape(model, name)
        layer = int(name.split(".")[2]) if ".layers." in name else 0
        kind = "Q6_K" if (layer + ("down" in name) + ("o_proj" in name)) % 2 else "Q4_K"
        if layer == 1 and any(f in name for f in flip):
            kind = "Q6_K" if kind == "Q4_K" else "Q4_K"
        raw = random_kblocks(KQTYPES[kind], n, k, gen, scale=0.0005)
        out.append((name, QuantizedTensor(raw, kind, (n, k))))
    return out


def _kquant_model(flip: tuple[str, ...] = ()):
    from lmkit.api import ModelBuildContext
    from lmkit_plugins.attention.cpu_backend import CpuAttention
    from lmkit_plugins.models.llama import LlamaForCausalLM
    from lmkit_plugins.quantization.gguf_cpu import GGUFCpuMethod
    from test_cpu_decode_stack import BLOCK, _config

    ctx = ModelBuildContext(torch.float32, torch.device("cpu"), BLOCK, CpuAttention,
                            quantization=GGUFCpuMethod(None, options=None))
    model = LlamaForCausalLM(_config(hidden_size=256, intermediate_size=512), ctx)
    model.load_weights(_kquant_weights(model, flip=flip))
    return model


@needs_executor
@pytest.mark.parametrize("flip", [(), ("v_proj",)], ids=["one-type", "mixed-qkv"])
def test_the_decode_stack_runs_k_quant_layers_bit_identically(monkeypatch, flip):
    """Including a layer whose value projection is Q6_K beside Q4_K query and key: the
    executor runs the fused QKV as two calls (its ``qkv_tail``), the Python layers as the
    method's mixed kernel, with the same bits."""
    on, off = _pair(monkeypatch, make=lambda: _kquant_model(flip))
    a, b = _Driver(on), _Driver(off)
    la = a.step([[5, 17, 3], [9, 2]])[1]
    lb = b.step([[5, 17, 3], [9, 2]])[1]
    runs = []
    real = on._cpu_decode.run
    on._cpu_decode.run = lambda *args: runs.append(1) or real(*args)
    for _ in range(6):
        nxt = la.argmax(-1).tolist()
        ha, la, _ = a.step([[t] for t in nxt])
        hb, lb, _ = b.step([[t] for t in nxt])
        assert torch.equal(ha, hb) and torch.equal(la, lb)
    assert len(runs) == 6


def _one_tensor(path: Path, kind: str, rows: int = 4, k: int = 512) -> Path:
    raw = random_kblocks(KQTYPES[kind], rows, k, torch.Generator().manual_seed(0)).numpy()
    return _write(path, [("blk.0.ffn_up.weight", raw, Q[kind]),
                         ("output_norm.weight", np.ones(64, dtype=np.float32), None)])


@pytest.mark.parametrize("kind", sorted(KQTYPES))
def test_truncated_k_quant_tensor_is_refused(tmp_path, kind):
    path = _write(tmp_path / "model.gguf", [
        ("output_norm.weight", np.ones(64, dtype=np.float32), None),
        ("blk.0.ffn_up.weight", random_kblocks(KQTYPES[kind], 4, 512,
                                               torch.Generator().manual_seed(0)).numpy(), Q[kind])])
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match=r"truncated: tensor 'blk.0.ffn_up.weight'|does not parse"):
        open_checked(path)


@pytest.mark.parametrize("kind", sorted(KQTYPES))
def test_k_quant_rows_of_partial_super_blocks_are_refused(tmp_path, kind):
    path = _one_tensor(tmp_path / "model.gguf", kind)
    _patch_tensor_info(path, "blk.0.ffn_up.weight", ne0=384)  # 1.5 super-blocks a row
    with pytest.raises(ModelLoadError, match=rf"(row size \(384\) is not a multiple of {kind} "
                                             rf"block size \(256\)|{kind}.*whole blocks of 256)"):
        open_checked(path)


@needs_executor
def test_a_qkv_of_three_type_runs_keeps_the_decode_stack_off():
    """Q4_K query, Q6_K key, Q4_K value: three row ranges, more than the executor's plan
    takes (two); it says which layer keeps the step on the Python layers, which run the
    method's mixed kernel."""
    from lmkit_plugins.models.cpu_decode_stack import build_cpu_decode_stack

    model = _kquant_model(flip=("k_proj",))
    stack, reason = build_cpu_decode_stack(model, model._quant)
    assert stack is None and "layer 1 is not on the quantized fast path" in reason
    assert model._cpu_decode is None
    hidden, logits, _ = _Driver(model).step([[5, 17, 3]])
    assert torch.isfinite(logits).all() and hidden.shape == (3, 256)


def test_q5_0_is_held_as_q8_0_exactly(tmp_path):
    """llama.cpp's Q4_K_M writes Q5_0 for rows that are not whole super-blocks; the
    method holds it as Q8_0 blocks of the same weights."""
    from lmkit_plugins.quantization.gguf_file import iterate_tensors, q5_0_as_q8_0

    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    w[0, :32] = 0.0
    raw = gguf.quants.quantize(w, Q.Q5_0)  # uint8 [6, 3 * 22]
    want = gguf.quants.dequantize(raw, Q.Q5_0)
    held = q5_0_as_q8_0(torch.from_numpy(raw))
    assert held.shape == (6, 3 * 34)
    assert np.array_equal(gguf.quants.dequantize(held.numpy(), Q.Q8_0), want)
    path = _write(tmp_path / "model.gguf", [("blk.0.ffn_up.weight", raw, Q.Q5_0)])
    (name, t), = iterate_tensors(open_checked(path), num_heads=2, num_kv_heads=1)
    assert name == "model.layers.0.mlp.up_proj.weight" and t.qtype == "Q8_0"
    assert t.shape == (6, 96) and torch.equal(t.data, held)
