"""The MLA attention backends (``mla_triton``, ``mla_flashinfer``) against the torch
reference on CUDA at DeepSeek's attention dimensions (kv_lora_rank 512, rope 64, nope
128, v 128; block 16) with DeepSeek-V2-Lite's 16 query heads and DeepSeek-V2/V3's 128
(8 of the decode kernel's head tiles): a decode batch (bf16, fp16, and fp32 for
mla_triton), a speculative (multi-token) batch, mixed prefill+decode batches with
cached prefixes and chunks, a prefill-only batch, the cache write, and a decode step
captured in a CUDA graph and replayed (identical to eager, right after the contexts
change).

The reference is :func:`lmkit_kernels.mla_ref.mla_attention_ref` (decompressed keys and
values, float32). ``mla_flashinfer`` skips, with the reason, without FlashInfer; it
compiles its kernels on first use (JIT, minutes): run with a generous timeout::

    python -m pytest -q -m gpu tests/gpu/test_mla_backends_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends import unavailable  # noqa: E402
from lmkit.api import AttentionMetadata, PluginHost  # noqa: E402
from lmkit_kernels.mla_batch import make_mla_batch  # noqa: E402
from lmkit_kernels.mla_ref import mla_attention_ref, mla_cache_write_ref  # noqa: E402

CUDA = torch.device("cuda")
DEEPSEEK = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
LITE_HEADS, V3_HEADS = 16, 128  # DeepSeek-V2-Lite; DeepSeek-V2/V3 on one GPU
HEADS = [pytest.param(LITE_HEADS, id="16heads"), pytest.param(V3_HEADS, id="128heads")]
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-3}
BACKENDS = [pytest.param(name, marks=pytest.mark.skipif(
    bool(unavailable(name)), reason=f"{name}: {unavailable(name)}"))
    for name in ("mla_triton", "mla_flashinfer")]


def _backend(name, dtype=torch.bfloat16, block_size=16, heads=LITE_HEADS, **options):
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    spec = host.registry.get("attention", name).spec
    dims = DEEPSEEK
    return spec.load()(
        num_heads=heads, num_kv_heads=1,
        head_size=dims["kv_lora_rank"] + dims["qk_rope_head_dim"],
        scale=(dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5, dtype=dtype,
        device=CUDA, block_size=block_size, options=spec.validate_options(options),
        **dims)


def _batch(reqs, dtype=torch.bfloat16, block_size=16, heads=LITE_HEADS, **kwargs):
    return make_mla_batch(reqs, num_heads=heads, **DEEPSEEK, block_size=block_size,
                          dtype=dtype, device=CUDA, **kwargs)


def _run(backend, batch, cache=None, md=None):
    cache = batch.kv_cache.clone() if cache is None else cache
    backend.plan(md or AttentionMetadata(**batch.layout.metadata_kwargs()))
    out = backend.run_mla(0, batch.q_nope, batch.q_pe, batch.kv_c, batch.k_pe, cache,
                          batch.w_kv_b)
    torch.cuda.synchronize()
    return out, cache


def _reference(batch):
    cache = batch.kv_cache.clone()
    mla_cache_write_ref(batch.kv_c, batch.k_pe, cache, batch.layout.slot_mapping)
    lay = batch.layout
    return mla_attention_ref(batch.q_nope, batch.q_pe, cache, batch.w_kv_b,
                             lay.query_start_loc, lay.seq_lens, lay.block_tables,
                             batch.scale), cache


def _compare(name, reqs, dtype=torch.bfloat16, block_size=16, extra_rows=0, seed=0,
             heads=LITE_HEADS, **options):
    batch = _batch(reqs, dtype, block_size, heads, extra_rows=extra_rows, table_width=320,
                   seed=seed)
    ref, ref_cache = _reference(batch)
    out, cache = _run(_backend(name, dtype, block_size, heads, **options), batch)
    n = batch.num_tokens
    assert out.shape == (batch.q_nope.shape[0], heads, DEEPSEEK["v_head_dim"])
    assert out.dtype == dtype
    assert torch.equal(cache, ref_cache)  # the same entries written to the same slots
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    assert torch.all(out[n:] == 0)


DECODE_CONTEXTS = (0, 15, 16, 100, 1023, 2048, 4095, 300, 7, 64)
# decodes first (as the runner orders them), then a fresh prompt, a prompt over a
# cached prefix, a chunk of a chunked prefill and a short multi-token query
MIXED = [(40, 1), (3000, 1), (1, 1), (0, 500), (256, 100), (1500, 512), (77, 5)]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_batch(name, dtype, heads):
    _compare(name, [(c, 1) for c in DECODE_CONTEXTS], dtype, extra_rows=3, heads=heads)


@pytest.mark.parametrize("heads", HEADS)
def test_mla_triton_float32(heads):
    _compare("mla_triton", [(c, 1) for c in DECODE_CONTEXTS], torch.float32, extra_rows=3,
             heads=heads)
    _compare("mla_triton", MIXED, torch.float32, seed=6, heads=heads)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("name", BACKENDS)
def test_speculative_multi_token_queries(name, heads):
    _compare(name, [(40, 4), (3000, 4), (1, 4), (511, 3)], seed=3, heads=heads)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("name", BACKENDS)
def test_mixed_prefill_decode_with_cached_prefix_and_chunks(name, heads):
    _compare(name, MIXED, seed=1, heads=heads)


@pytest.mark.parametrize("name", BACKENDS)
def test_prefill_only_block_32(name):
    _compare(name, [(0, 37), (500, 64), (999, 130)], block_size=32, seed=2)


def test_mla_triton_split_counts_agree():
    reqs = [(c, 1) for c in (5, 700, 4000)]
    for splits in (1, 2, 16):
        _compare("mla_triton", reqs, seed=4, decode_num_splits=splits)


def test_mla_triton_128_head_tilings_agree():
    """V3's 128 heads: the default 64-row, eight-warp tiles with up to 64 slices, and
    the 16/32-head tilings (``decode_head_tile``), on decodes and speculative queries."""
    decodes = [(c, 1) for c in (5, 700, 4000)]
    for options in ({}, {"decode_num_splits": 64}, {"decode_num_splits": 1}):
        _compare("mla_triton", decodes + [(300, 4), (2000, 2)], seed=4, heads=V3_HEADS,
                 **options)
    for tile in (16, 32):
        _compare("mla_triton", decodes, seed=4, heads=V3_HEADS, decode_head_tile=tile)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("name", BACKENDS)
def test_decode_cuda_graph_replay_is_identical_to_eager(name, heads):
    num_reqs = 8
    kwargs = dict(num_blocks=1200, table_width=260, heads=heads)
    state = _batch([(20, 1)] * num_reqs, **kwargs)  # fixed-address buffers
    lay = state.layout
    backend = _backend(name, heads=heads)
    backend.plan(AttentionMetadata(**lay.metadata_kwargs(cuda_graph=True)))

    def step():
        return backend.run_mla(0, state.q_nope, state.q_pe, state.kv_c, state.k_pe,
                               state.kv_cache, state.w_kv_b)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()

    # the next step: longer contexts, other blocks, new inputs, written in place
    new = _batch([(4000, 1), (3, 1), (2047, 1), (160, 1)] * 2, seed=5, **kwargs)
    # the last two are the runner's padding requests: no context, cache slot -1, rows
    # never read
    new.layout.seq_lens[-2:] = 0
    new.layout.seq_lens_cpu[-2:] = 0
    new.layout.slot_mapping[-2:] = -1
    real = num_reqs - 2
    for field in ("q_nope", "q_pe", "kv_c", "k_pe", "kv_cache", "w_kv_b"):
        getattr(state, field).copy_(getattr(new, field))
    for field in ("seq_lens", "block_tables", "slot_mapping"):
        getattr(lay, field).copy_(getattr(new.layout, field))
    md = AttentionMetadata(**new.layout.metadata_kwargs(cuda_graph=True))
    md.query_start_loc, md.seq_lens = lay.query_start_loc, lay.seq_lens
    md.block_tables, md.slot_mapping = lay.block_tables, lay.slot_mapping
    backend.plan(md)
    graph.replay()
    replayed = graph_out.clone()
    cache_after = state.kv_cache.clone()
    state.kv_cache.copy_(new.kv_cache)
    backend.plan(md)
    eager = step()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
    ref, ref_cache = _reference(new)
    assert torch.equal(cache_after, ref_cache)
    torch.testing.assert_close(replayed[:real].float(), ref[:real].float(), atol=3e-2,
                               rtol=3e-2)
