"""The KV-cache write fused into the RoPE kernel, and the backend opt-in that lets a
model use it, in Triton's CPU interpreter at tiny shapes.

* :func:`lmkit_kernels.rotary.rotary_qk_` with ``kv_cache``/``slot_mapping`` stores the
  rotated keys and the values exactly where ``reshape_and_cache`` would (padding slots
  and rows past ``slot_mapping`` skipped) and leaves every other slot alone;
* the triton backend declares ``supports_model_kv_write`` and ``run(..., kv_written=True)``
  does not write the cache; the torch reference backend does not opt in;
* a tiny Llama with the fused kernels on, over the triton backend (the model writes
  K/V) and over the same backend without the opt-in (it writes them), fills
  bit-identical caches and computes the same hidden states.
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu")
torch = pytest.importorskip("torch")

from lmkit.api import AttentionMetadata, ForwardContext, ModelBuildContext  # noqa: E402
from lmkit_kernels.cache_write import reshape_and_cache  # noqa: E402
from lmkit_kernels.interpreter import bf16_round_to_nearest  # noqa: E402
from lmkit_kernels.random_batch import make_paged_batch  # noqa: E402
from lmkit_kernels.reference import reshape_and_cache_ref  # noqa: E402
from lmkit_kernels.rotary import rotary_qk_, rotary_qk_ref  # noqa: E402
from lmkit_plugins.attention.torch_ref import TorchAttention  # noqa: E402
from lmkit_plugins.attention.triton_backend import TritonAttention  # noqa: E402


@pytest.fixture(autouse=True)
def gpu_rounding():
    with bf16_round_to_nearest() as patched:
        yield patched


def _cos_sin(n, rot, dtype):
    pos = torch.arange(n, dtype=torch.float32)[:, None] * 3.1
    freqs = pos * torch.linspace(1.0, 0.01, rot // 2)[None, :]
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None, :].to(dtype)
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)[:, None, :].to(dtype)
    return cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
def test_rotary_writes_rotated_keys_and_values(dtype, qk_norm, block_size):
    heads, kv_heads, size, n = 6, 2, 32, 7
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * size, generator=g).to(dtype)
    cos, sin = _cos_sin(n, size, dtype)
    norms = {}
    if qk_norm:
        norms = {"q_norm": (1 + 0.2 * torch.randn(size, generator=g)).to(dtype),
                 "k_norm": (1 + 0.2 * torch.randn(size, generator=g)).to(dtype)}
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_size=size, **norms)
    cache = torch.randn(2, 5, block_size, kv_heads, size, generator=g).to(dtype)
    # 5 of 7 rows have slots (the last two are CUDA-graph padding), one is a padding slot
    slots = torch.randperm(5 * block_size, generator=g)[:5].to(torch.int32)
    slots[1] = -1

    out, written = qkv.clone(), cache.clone()
    rotary_qk_(out, cos, sin, kv_cache=written, slot_mapping=slots, **kw)
    expected = rotary_qk_ref(qkv, cos, sin, **kw)
    plain = qkv.clone()
    rotary_qk_(plain, cos, sin, **kw)
    assert torch.equal(out, plain)  # the cache write does not change the rotation
    ulp = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=ulp, rtol=ulp)
    rows = out.view(n, -1, size)
    reshape_and_cache_ref(rows[:, heads:heads + kv_heads], rows[:, heads + kv_heads:], cache,
                          slots.long())
    assert torch.equal(written, cache)  # the same slots, and nothing else


def test_rotary_cache_arguments_are_checked():
    qkv = torch.randn(3, (4 + 2 * 2) * 16)
    cos = torch.ones(3, 1, 16)
    kw = dict(num_heads=4, num_kv_heads=2, head_size=16)
    cache = torch.zeros(2, 4, 8, 2, 16)
    with pytest.raises(ValueError, match="both kv_cache and slot_mapping"):
        rotary_qk_(qkv, cos, cos, kv_cache=cache, **kw)
    with pytest.raises(ValueError, match=r"kv_cache must have shape \[2, \*, \*, 2, 16\]"):
        rotary_qk_(qkv, cos, cos, kv_cache=cache[:, :, :, :1], slot_mapping=torch.arange(3), **kw)
    with pytest.raises(ValueError, match="kv_cache has dtype bfloat16"):
        rotary_qk_(qkv, cos, cos, kv_cache=cache.bfloat16(), slot_mapping=torch.arange(3), **kw)
    with pytest.raises(ValueError, match="slot_mapping has 4 entries"):
        rotary_qk_(qkv, cos, cos, kv_cache=cache, slot_mapping=torch.arange(4), **kw)


def _metadata(batch):
    return AttentionMetadata(**batch.metadata_kwargs())


def test_triton_backend_skips_its_write_when_the_model_wrote_kv():
    kwargs = dict(num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    batch = make_paged_batch([(20, 1), (0, 6)], extra_rows=2, seed=1, **kwargs)
    backend = TritonAttention(scale=64 ** -0.5, dtype=torch.float32,
                              device=torch.device("cpu"), **kwargs)
    with pytest.raises(RuntimeError, match="before plan"):
        backend.kv_write_slots()
    backend.plan(_metadata(batch))
    slots = backend.kv_write_slots()
    assert torch.equal(slots, batch.slot_mapping[:batch.num_tokens])
    cache = batch.kv_cache.clone()
    expected = backend.run(0, batch.q, batch.k, batch.v, cache)  # writes k/v itself
    before = cache.clone()
    junk = torch.full_like(batch.k, 1e4)  # would corrupt the cache if written
    out = backend.run(0, batch.q, junk, junk, cache, kv_written=True)
    assert torch.equal(cache, before)
    assert torch.equal(out, expected)
    torch_backend = TorchAttention(scale=64 ** -0.5, dtype=torch.float32,
                                   device=torch.device("cpu"), **kwargs)
    torch_backend.plan(_metadata(batch))
    assert not TorchAttention.supports_model_kv_write  # the default: the backend writes
    with pytest.raises(NotImplementedError, match="does not declare supports_model_kv_write"):
        torch_backend.kv_write_slots()


def _tiny_llama(attention_cls, monkeypatch):
    """A 2-layer bf16 Llama on the CPU with the fused kernels forced on (interpreted)."""
    from lmkit_plugins.models import fused_ops, layers, llama, llama_layers
    from transformers import LlamaConfig

    for module in (fused_ops, layers, llama, llama_layers):
        monkeypatch.setattr(module, "fused_ops_enabled", lambda device, dtype: True)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, tie_word_embeddings=True)
    ctx = ModelBuildContext(dtype=torch.bfloat16, device=torch.device("cpu"), block_size=4,
                            attention_cls=attention_cls)
    model = llama.LlamaForCausalLM(config, ctx)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if p.dim() == 1
                    else 0.2 * torch.randn(p.shape, generator=g))
    return model


class _BackendWrites(TritonAttention):
    """The triton backend without the opt-in: its run() writes K/V itself."""

    supports_model_kv_write = False


def test_llama_writes_kv_in_the_rope_kernel_when_the_backend_opts_in(monkeypatch):
    from lmkit_plugins.attention import triton_backend

    # one step: a 5-token prompt (blocks 3, 1) and a 3-token prompt over block 2
    qsl = torch.tensor([0, 5, 8], dtype=torch.int32)
    seq_lens = torch.tensor([5, 3], dtype=torch.int32)
    block_tables = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    slots = torch.tensor([12, 13, 14, 15, 4, 8, 9, 10])
    md = AttentionMetadata(num_reqs=2, num_actual_tokens=8, max_query_len=5, max_seq_len=5,
                           query_start_loc=qsl, seq_lens=seq_lens, block_tables=block_tables,
                           slot_mapping=slots, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    ids = torch.tensor([1, 7, 3, 9, 60, 2, 5, 33])
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    backend_writes = []
    monkeypatch.setattr(triton_backend, "reshape_and_cache",
                        lambda *a: (backend_writes.append(1), reshape_and_cache(*a)))
    results = []
    for cls in (TritonAttention, _BackendWrites):
        model = _tiny_llama(cls, monkeypatch)
        caches = [torch.zeros(model.attn.kv_cache_shape(5), dtype=torch.bfloat16)
                  for _ in range(2)]
        model.attn.plan(md)
        with torch.inference_mode():
            hidden = model(ids, positions, ForwardContext(model.attn, caches))
        results.append((hidden, caches, len(backend_writes)))
    (fused_hidden, fused_caches, fused_writes), (ref_hidden, ref_caches, all_writes) = results
    assert fused_writes == 0 and all_writes == 2  # the backend wrote only without the opt-in
    for fused, ref in zip(fused_caches, ref_caches, strict=True):
        assert torch.equal(fused, ref)
        assert fused[:, 1:4].abs().sum() > 0 and fused[:, 4].abs().sum() == 0
    assert torch.equal(fused_hidden, ref_hidden)
