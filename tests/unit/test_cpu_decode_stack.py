"""lmkit's C decode-stack executor (:mod:`lmkit_kernels.cpu.decode_stack`, decided by
:mod:`lmkit_plugins.models.cpu_decode_stack`): a tiny random Llama with GGUF-quantized
weights gives the same bits (hidden states, logits, greedy tokens) with the executor as
with the Python-sequenced layers, at batch 1 and for small batches; steps it does not
take (prompts longer than the backend's flattened queries) and models it does not take
fall back to the Python layers; a draft head's taps come out of it with the same bits;
the switch and an unbuildable library turn it off."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from lmkit.api import (  # noqa: E402
    AttentionMetadata,
    ForwardContext,
    ModelBuildContext,
    QuantizedTensor,
)
from lmkit_kernels.cpu import decode_stack  # noqa: E402
from lmkit_kernels.cpu.qgemv import QTYPES, qgemv_isa, random_blocks  # noqa: E402
from lmkit_plugins.attention.cpu_backend import CpuAttention  # noqa: E402
from lmkit_plugins.attention.torch_ref import TorchAttention  # noqa: E402
from lmkit_plugins.models.layers import RMSNorm  # noqa: E402
from lmkit_plugins.models.llama import LlamaForCausalLM  # noqa: E402
from lmkit_plugins.quantization.gguf_cpu import GGUFCpuMethod  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 24
# the executor needs qgemv's AVX-512 VNNI build (the SiLU fold); elsewhere it is off
_kernels, _why = decode_stack._kernel_addresses()
needs_executor = pytest.mark.skipif(_kernels is None or decode_stack._library()[0] is None,
                                    reason=_why or decode_stack.decode_stack_unavailable_reason())


def _config(**kw):
    return transformers.LlamaConfig(**{
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
        **kw})


def _weights(model, seed: int = 0):
    """Random checkpoint tensors: projections and the embedding as GGUF blocks (a mix
    of types: one per layer and projection, as fused parts share theirs), norms dense."""
    gen = torch.Generator().manual_seed(seed)
    types = ["Q4_1", "Q4_0", "Q8_0"]
    out = []
    for name in sorted(model._weight_targets()):
        if name.endswith("norm.weight"):
            size = model.dims.hidden_size
            out.append((name, torch.rand(size, generator=gen) + 0.5))
            continue
        n, k = _shape(model, name)
        if name.endswith(".bias"):
            out.append((name, torch.randn(n, generator=gen) * 0.1))
            continue
        layer = int(name.split(".")[2]) if ".layers." in name else 0
        fused = "attn" if "self_attn" in name and "o_proj" not in name else name[-16:]
        qtype = "Q8_0" if "embed" in name else types[(layer + len(fused)) % 3]
        out.append((name, QuantizedTensor(random_blocks(QTYPES[qtype], n, k, gen), qtype, (n, k))))
    return out


def _shape(model, name: str) -> tuple[int, int]:
    d = model.dims
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    for part, shape in (("embed", (d.vocab_size, d.hidden_size)), ("q_proj", (q, d.hidden_size)),
                        ("k_proj", (kv, d.hidden_size)), ("v_proj", (kv, d.hidden_size)),
                        ("o_proj", (d.hidden_size, q)),
                        ("gate_proj", (d.intermediate_size, d.hidden_size)),
                        ("up_proj", (d.intermediate_size, d.hidden_size)),
                        ("down_proj", (d.hidden_size, d.intermediate_size))):
        if part in name:
            return shape
    raise AssertionError(name)


def _default_model(smollm2_dir):
    """The default model (SmolLM2-135M Q4_1) loaded as the model runner loads it."""
    from lmkit.loading.model_facts import load_model_facts
    from lmkit.plugin_host.manager import PluginHost

    facts = load_model_facts(smollm2_dir, PluginHost.load(
        env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}))
    quant = GGUFCpuMethod(facts, options=None)
    quant.check()
    ctx = ModelBuildContext(torch.float32, torch.device("cpu"), BLOCK, CpuAttention,
                            quantization=quant)
    model = LlamaForCausalLM(transformers.AutoConfig.from_pretrained(smollm2_dir), ctx)
    model.load_weights(quant.iterate_weights())
    return model


def _model(attention=CpuAttention, config=None):
    quant = GGUFCpuMethod(None, options=None)  # the facts only serve reading a file
    ctx = ModelBuildContext(torch.float32, torch.device("cpu"), BLOCK, attention,
                            quantization=quant)
    model = LlamaForCausalLM(config or _config(), ctx)
    model.load_weights(_weights(model))
    return model


class _Driver:
    """Requests on a paged cache: ``step(tokens)`` feeds each request its tokens
    (a list per request) and returns (hidden, logits at each request's last token)."""

    def __init__(self, model) -> None:
        self.model = model
        self.caches = [torch.zeros(model.attn.kv_cache_shape(NUM_BLOCKS))
                       for _ in model.model.layers]
        self.lens: list[int] = []

    def step(self, tokens: list[list[int]], aux: tuple[int, ...] = ()):
        while len(self.lens) < len(tokens):
            self.lens.append(0)
        per_req = NUM_BLOCKS // len(tokens)
        ids, pos, slots, qsl = [], [], [], [0]
        for r, toks in enumerate(tokens):
            for j, t in enumerate(toks):
                p = self.lens[r] + j
                ids.append(t)
                pos.append(p)
                slots.append((r * per_req + p // BLOCK) * BLOCK + p % BLOCK)
            qsl.append(qsl[-1] + len(toks))
            self.lens[r] += len(toks)
        n = len(tokens)
        seq = torch.tensor(self.lens[:n], dtype=torch.int32)
        tables = torch.arange(n * per_req, dtype=torch.int32).view(n, per_req)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        md = AttentionMetadata(
            num_reqs=n, num_actual_tokens=len(ids), max_query_len=max(map(len, tokens)),
            max_seq_len=int(seq.max()), query_start_loc=qsl_t, seq_lens=seq,
            block_tables=tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=qsl_t, seq_lens_cpu=seq)
        self.model.attn.plan(md)
        ctx = ForwardContext(self.model.attn, self.caches, aux)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), ctx)
            logits = self.model.compute_logits(hidden[qsl_t[1:].long() - 1])
        return hidden, logits, ctx.aux_hidden_states


def _counting(model):
    """Count the steps the executor ran."""
    runs = []
    real = model._cpu_decode.run

    def run(*args):
        out = real(*args)
        runs.append(out is not None)
        return out

    model._cpu_decode.run = run
    return runs


def _pair(monkeypatch, make=_model):
    on = make()
    monkeypatch.setenv(decode_stack.DISABLE_ENV, "0")
    off = make()
    monkeypatch.delenv(decode_stack.DISABLE_ENV)
    assert on._cpu_decode is not None and off._cpu_decode is None
    return on, off


@needs_executor
@pytest.mark.parametrize("batch", [1, 3])
def test_executor_is_bit_identical_to_the_python_layers(monkeypatch, batch):
    on, off = _pair(monkeypatch)
    runs = _counting(on)
    a, b = _Driver(on), _Driver(off)
    prompts = [[5 + r, 17, 3 * r + 1, 40][: 2 + r] for r in range(batch)]
    ha, la, _ = a.step(prompts)  # short prompts: a row per token, on the executor too
    hb, lb, _ = b.step(prompts)
    assert torch.equal(ha, hb) and torch.equal(la, lb)
    for _ in range(20):  # greedy decoding past a block boundary (16 slots)
        next_a = la.argmax(-1).tolist()
        assert next_a == lb.argmax(-1).tolist()
        ha, la, _ = a.step([[t] for t in next_a])
        hb, lb, _ = b.step([[t] for t in next_a])
        assert torch.equal(ha, hb) and torch.equal(la, lb)
    assert runs == [True] * 21
    for ca, cb in zip(a.caches, b.caches, strict=True):
        assert torch.equal(ca, cb)


@needs_executor
@pytest.mark.slow
def test_the_default_model_gives_the_same_bits(monkeypatch, smollm2_dir):
    """SmolLM2-135M Q4_1: hidden states, logits and greedy tokens of 12 decode steps at
    batch 1 and 2 equal the Python layers' (and the caches they wrote)."""
    on, off = _pair(monkeypatch, lambda: _default_model(smollm2_dir))
    runs = _counting(on)
    a, b = _Driver(on), _Driver(off)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 7045, 30, 14]]
    for batch in (1, 2):
        a.lens, b.lens = [], []
        ha, la, _ = a.step(prompts[:batch])
        hb, lb, _ = b.step(prompts[:batch])
        for _ in range(12):
            tokens = la.argmax(-1).tolist()
            assert tokens == lb.argmax(-1).tolist()
            ha, la, _ = a.step([[t] for t in tokens])
            hb, lb, _ = b.step([[t] for t in tokens])
            assert torch.equal(ha, hb) and torch.equal(la, lb)
    assert runs == [True] * 26
    assert all(torch.equal(x, y) for x, y in zip(a.caches, b.caches, strict=True))


@needs_executor
def test_a_sliding_window_and_qkv_bias_are_followed(monkeypatch):
    config = _config(sliding_window=6, attention_bias=True)
    on = _model(config=config)
    monkeypatch.setenv(decode_stack.DISABLE_ENV, "0")
    off = _model(config=config)
    monkeypatch.delenv(decode_stack.DISABLE_ENV)
    if on._cpu_decode is None:
        pytest.skip("this config is not on the executor's path")
    a, b = _Driver(on), _Driver(off)
    la = lb = None
    for step in [[[1, 2, 3]]] + [[[t]] for t in range(7, 19)]:
        ha, la, _ = a.step(step)
        hb, lb, _ = b.step(step)
        assert torch.equal(ha, hb) and torch.equal(la, lb)


@needs_executor
def test_draft_head_taps_are_copied_out_in_the_call(monkeypatch):
    """An EAGLE-3 head's taps (the stream entering layers 0 and 2, one twice) come out
    of the executor with the Python layers' bits, for a decode step and for a
    verification-like step of four tokens per request."""
    on, off = _pair(monkeypatch)
    runs = _counting(on)
    a, b = _Driver(on), _Driver(off)
    a.step([[1, 2, 3], [9, 8]])
    b.step([[1, 2, 3], [9, 8]])
    for step in ([[4], [5]], [[6, 7, 8, 9], [10, 11, 12, 13]]):
        ha, la, aux_a = a.step(step, aux=(0, 2, 2))
        hb, lb, aux_b = b.step(step, aux=(0, 2, 2))
        assert torch.equal(ha, hb) and torch.equal(la, lb) and len(aux_a) == 3
        assert all(torch.equal(x, y) for x, y in zip(aux_a, aux_b, strict=True))
        assert not torch.equal(aux_a[0], aux_a[1])  # layer 0's input is not layer 2's
    assert runs == [True, True, True]


@needs_executor
def test_a_long_prompt_takes_the_python_layers(monkeypatch):
    """A prompt longer than the backend's flattened queries (MAX_FLAT_QUERY tokens) is a
    prefill the Python layers run; the decode steps after it take the executor, with the
    same bits."""
    from lmkit_plugins.attention.cpu_backend import MAX_FLAT_QUERY

    on, off = _pair(monkeypatch)
    runs = _counting(on)
    a, b = _Driver(on), _Driver(off)
    prompt = [[(7 * i) % 90 + 1 for i in range(MAX_FLAT_QUERY + 1)]]
    ha, la, _ = a.step(prompt)
    hb, lb, _ = b.step(prompt)
    assert torch.equal(ha, hb) and torch.equal(la, lb)
    for _ in range(3):
        tokens = [[t] for t in la.argmax(-1).tolist()]
        ha, la, _ = a.step(tokens)
        hb, lb, _ = b.step(tokens)
        assert torch.equal(ha, hb) and torch.equal(la, lb)
    assert runs == [False, True, True, True]


@needs_executor
def test_models_off_the_fast_path_keep_the_python_layers():
    # the torch attention backend hands out no paged decode arguments
    model = _model(attention=TorchAttention)
    assert model._cpu_decode is None
    # q/k norms (Qwen3) are not on the executor's path
    from lmkit_plugins.models.cpu_decode_stack import build_cpu_decode_stack

    model = _model()
    assert model._cpu_decode is not None
    model.model.layers[1].self_attn.q_norm = RMSNorm(16, 1e-6, dtype=torch.float32,
                                                     device=torch.device("cpu"))
    stack, reason = build_cpu_decode_stack(model, model._quant)
    assert stack is None and "layer 1" in reason
    # dense weights: no quantization method
    stack, reason = build_cpu_decode_stack(model, None)
    assert stack is None and "gguf" in reason


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(decode_stack.DISABLE_ENV, "off")
    assert decode_stack.decode_stack_disabled()
    stack, reason = decode_stack.make_decode_stack([], hidden=1)
    assert stack is None and decode_stack.DISABLE_ENV in reason
    if qgemv_isa():  # the gguf method builds (else no quantized model at all)
        assert _model()._cpu_decode is None


def test_a_kernel_library_with_another_abi_turns_it_off(monkeypatch):
    """decode_stack.c declares the kernels' signatures: a library whose ABI moved may
    have other ones, so the executor stays off and says which."""
    monkeypatch.setitem(decode_stack._ABIS, "qgemv", -1)
    decode_stack._kernel_addresses.cache_clear()
    try:
        stack, reason = decode_stack.make_decode_stack([], hidden=1)
        assert stack is None and "qgemv's ABI" in reason
    finally:
        decode_stack._kernel_addresses.cache_clear()


def test_an_unbuildable_library_keeps_the_python_layers(monkeypatch, tmp_path, caplog):
    """The loader returns None with one warning (as every C kernel's does), the model
    runs its Python layers."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("LMKIT_CACHE", str(tmp_path / "cache"))
    decode_stack._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            lib, reason = decode_stack._library()
        assert lib is None and "compiler" in reason
        warnings = [r for r in caplog.records if "decode-stack executor" in r.getMessage()]
        assert len(warnings) == 1
        assert "Python-sequenced" in warnings[0].getMessage()
        if _kernels is not None:
            model = _model()
            assert model._cpu_decode is None
            a = _Driver(model)
            a.step([[1, 2]])
            a.step([[3]])  # a decode step through the Python layers
    finally:
        decode_stack._library.cache_clear()
