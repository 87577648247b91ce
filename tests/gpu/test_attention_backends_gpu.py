"""The triton, flashinfer and flash_attn attention backends against the torch reference
backend on CUDA: the same random paged caches, bf16 and fp16, head sizes 64/128/256, a
decode batch, mixed prefill+decode batches with cached prefixes and chunks, and a decode
step captured in a CUDA graph and replayed (identical to the eager result).

The flashinfer and flash_attn cases skip, with the reason, when their library is not
installed. Both compile their kernels on first use (JIT, minutes): run this file with a
generous timeout (FlashAttention-4 keeps compiled kernels on disk with
``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends import backend_params, unavailable  # noqa: E402
from lmkit.api import AttentionMetadata, PluginHost  # noqa: E402
from lmkit_kernels.random_batch import make_paged_batch  # noqa: E402
from lmkit_plugins.attention.torch_ref import TorchAttention  # noqa: E402

CUDA = torch.device("cuda")
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
BACKENDS = backend_params("triton", "flashinfer", "flash_attn")
# FlashInfer compiles one module per (dtype, head size, kernel): keep its matrix small
CONFIGS = [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.bfloat16, 256),
           (torch.float16, 128)]


def _backend_class(name):
    """The backend class, loaded through the plugin registry as the engine does."""
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    registration = host.registry.get("attention", name)
    assert registration.spec.unavailable_reasons() == []
    return registration.spec.load()


def _make(cls, dtype, head_size, num_heads=32, num_kv_heads=8, block_size=16):
    return cls(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
               scale=head_size ** -0.5, dtype=dtype, device=CUDA, block_size=block_size)


def _metadata(batch, **overrides):
    return AttentionMetadata(**batch.metadata_kwargs(**overrides))


def _run(backend, batch, md=None):
    """Plan and run one layer on a copy of the batch's cache; returns (out, cache)."""
    cache = batch.kv_cache.clone()
    backend.plan(md or _metadata(batch))
    out = backend.run(0, batch.q, batch.k, batch.v, cache)
    torch.cuda.synchronize()
    return out, cache


def _compare(name, reqs, dtype, head_size, extra_rows=0, block_size=16, seed=0):
    batch = make_paged_batch(reqs, num_heads=32, num_kv_heads=8, head_size=head_size,
                             block_size=block_size, dtype=dtype, device=CUDA,
                             extra_rows=extra_rows, table_width=320, seed=seed)
    ref, ref_cache = _run(_make(TorchAttention, dtype, head_size, block_size=block_size), batch)
    out, cache = _run(_make(_backend_class(name), dtype, head_size, block_size=block_size),
                      batch)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert torch.equal(cache, ref_cache)  # the same K/V written to the same slots
    n = batch.num_tokens
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    assert torch.all(out[n:] == 0)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("dtype", "head_size"), CONFIGS)
def test_decode_batch(name, dtype, head_size):
    reqs = [(c, 1) for c in (0, 15, 16, 100, 1023, 2048, 4095, 300, 7, 64)]
    _compare(name, reqs, dtype, head_size, extra_rows=3)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("dtype", "head_size"), CONFIGS)
def test_mixed_prefill_decode_with_cached_prefix(name, dtype, head_size):
    # decodes first (as the runner orders them), then a fresh prompt, a prompt over a
    # cached prefix, a chunk of a chunked prefill and a multi-token (speculative) query
    reqs = [(40, 1), (3000, 1), (1, 1), (0, 500), (256, 100), (1500, 512), (77, 5)]
    _compare(name, reqs, dtype, head_size, seed=1)


@pytest.mark.parametrize("name", BACKENDS)
def test_prefill_first_then_decodes_block_32(name):
    reqs = [(0, 37), (500, 1), (16, 1), (999, 64)]
    _compare(name, reqs, torch.bfloat16, 128, block_size=32, seed=2)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_cuda_graph_replay_is_identical_to_eager(name, dtype):
    head_size, num_reqs = 128, 8
    kwargs = dict(num_heads=32, num_kv_heads=8, head_size=head_size, block_size=16,
                  dtype=dtype, device=CUDA, num_blocks=1200, table_width=260)
    state = make_paged_batch([(20, 1)] * num_reqs, **kwargs)  # fixed-address buffers
    backend = _make(_backend_class(name), dtype, head_size)
    backend.plan(_metadata(state, cuda_graph=True))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        backend.run(0, state.q, state.k, state.v, state.kv_cache)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.run(0, state.q, state.k, state.v, state.kv_cache)

    # the next step: longer contexts, other blocks, new inputs, written in place
    step = make_paged_batch([(4000, 1), (3, 1), (2047, 1), (160, 1)] * 2, seed=5, **kwargs)
    for field in ("q", "k", "v", "kv_cache", "seq_lens", "block_tables", "slot_mapping"):
        getattr(state, field).copy_(getattr(step, field))
    md = _metadata(step, cuda_graph=True)
    md.query_start_loc, md.seq_lens = state.query_start_loc, state.seq_lens
    md.block_tables, md.slot_mapping = state.block_tables, state.slot_mapping
    backend.plan(md)
    graph.replay()
    replayed = graph_out.clone()
    backend.plan(md)
    eager = backend.run(0, state.q, state.k, state.v, state.kv_cache)
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
    ref, _ = _run(_make(TorchAttention, dtype, head_size), step)
    torch.testing.assert_close(replayed.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("name", BACKENDS)
def test_model_written_kv_skips_the_backends_write(name):
    """Every backend here opts in to the model's fused K/V write: ``kv_write_slots`` is the
    step's slot_mapping, and ``run(..., kv_written=True)`` reads the cache as the model
    left it (junk k/v arguments are not written) with the same result."""
    reqs = [(40, 1), (3000, 1), (0, 300), (256, 100)]
    batch = make_paged_batch(reqs, num_heads=32, num_kv_heads=8, head_size=128,
                             block_size=16, dtype=torch.bfloat16, device=CUDA, extra_rows=2,
                             table_width=320, seed=6)
    backend = _make(_backend_class(name), torch.bfloat16, 128)
    backend.plan(_metadata(batch))
    assert torch.equal(backend.kv_write_slots(), batch.slot_mapping[:batch.num_tokens])
    cache = batch.kv_cache.clone()
    expected = backend.run(0, batch.q, batch.k, batch.v, cache)
    written = cache.clone()
    junk = torch.full_like(batch.k, 100.0)
    out = backend.run(0, batch.q, junk, junk, cache, kv_written=True)
    torch.cuda.synchronize()
    assert torch.equal(cache, written)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("name", backend_params("flash_attn"))
@pytest.mark.parametrize(("head_size", "block_size"), [(128, 128), (64, 128), (128, 64)])
def test_flash_attn_pages_of_one_key_tile_and_others(name, head_size, block_size):
    """FlashAttention-4 loads whole pages by TMA when a page is one key tile (128 rows on
    Hopper for head sizes up to 128), else row by row: both paths, one mixed batch."""
    reqs = [(40, 1), (3000, 1), (0, 1), (0, 300), (256, 100), (77, 5)]
    _compare(name, reqs, torch.bfloat16, head_size, block_size=block_size, extra_rows=2, seed=7)


def test_flash_attn_runs_the_generation_plugins_list_names():
    reason = unavailable("flash_attn")
    if reason:
        pytest.skip(f"flash_attn: {reason}")
    from lmkit.plugin_host.report import spec_report
    from lmkit.plugin_host.spec import module_present

    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    report = spec_report(host.registry.get("attention", "flash_attn"))
    backend = _make(_backend_class("flash_attn"), torch.bfloat16, 128)
    assert backend.generation == report["variant"]
    if module_present("flash_attn.cute") and torch.cuda.get_device_capability()[0] in (9, 10):
        assert backend.generation == "fa4"


def test_auto_prefers_triton_on_cuda_and_flashinfer_by_name():
    # triton (priority 60) ranks above flashinfer (55) since session 10, installed or not
    from lmkit.api import Needs

    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    needs = Needs(values={"device": "cuda", "dtype": "bfloat16"})
    assert host.registry.select("attention", "auto", needs).name == "triton"
    if HAS_FLASHINFER:
        assert host.registry.select("attention", "flashinfer", needs).name == "flashinfer"
