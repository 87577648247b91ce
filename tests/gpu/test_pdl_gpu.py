"""Programmatic dependent launch (:mod:`lmkit_kernels.pdl`) on a Hopper GPU: with it on,
every kernel of a decode layer still reads its predecessor's finished output.

* One Llama-3.1-8B-shape decode layer at one row as the model runs it (RMSNorm fold +
  QKV GEMV, RoPE + cache write, decode attention, output GEMV, RMSNorm, gate-up GEMV,
  SiLU, down GEMV), eight times in a row, captured in a CUDA graph with PDL on and
  replayed with a *different* input each time: each replay's output is bit-identical to
  the same layers run eagerly with PDL off. A kernel that read its input before its
  predecessor finished would see the previous replay's values.
* A 2-layer Llama-3.1-8B-shape model generates the same greedy tokens with ``LMKIT_PDL``
  on and off under CUDA graphs, at batch 1 and 5.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_only import require_cuda_and_triton  # noqa: E402

require_cuda_and_triton()
pytestmark = pytest.mark.gpu

import torch  # noqa: E402
from backends import backend_params  # noqa: E402
from copy_circuit_model import (  # noqa: E402
    generate_greedy,
    llama_config,
    write_copy_circuit_model,
)
from lmkit_kernels import pdl  # noqa: E402
from lmkit_kernels.activation import silu_and_mul  # noqa: E402
from lmkit_kernels.gemv import small_m_linear  # noqa: E402
from lmkit_kernels.gemv_fold import norm_small_m_linear, silu_mul_small_m_linear  # noqa: E402
from lmkit_kernels.norm import rms_norm  # noqa: E402
from lmkit_kernels.paged_attention import paged_attention, split_counters  # noqa: E402
from lmkit_kernels.random_batch import make_paged_batch  # noqa: E402
from lmkit_kernels.rotary import rotary_qk_  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD, INTER = 4096, 32, 8, 128, 14336
LAYERS = 8

needs_hopper = pytest.mark.skipif(torch.cuda.get_device_capability() < (9, 0),
                                  reason="programmatic dependent launch needs SM 9.0+")


def _layer_weights(g):
    def w(*shape):
        return (torch.randn(shape, generator=g, device="cuda") * shape[-1] ** -0.5
                ).to(torch.bfloat16)
    qkv = (HEADS + 2 * KV_HEADS) * HEAD
    return {"qkv": w(qkv, HIDDEN), "o": w(HIDDEN, HEADS * HEAD), "gate_up": w(2 * INTER, HIDDEN),
            "down": w(HIDDEN, INTER),
            "ln1": 1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda").to(torch.bfloat16),
            "ln2": 1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda").to(torch.bfloat16)}


def _layers(x, layers, batch, caches, cos, sin, counters):
    # even layers as the bf16 model runs at one row (norms and SiLU folded into the
    # GEMVs), odd layers with the separate RMSNorm and SiLU kernels (the FP8 path)
    residual = None
    for i, p in enumerate(layers):
        if i % 2 == 0:
            qkv, residual = norm_small_m_linear(x, residual, p["ln1"], 1e-5, p["qkv"])
        else:
            h, residual = rms_norm(x, p["ln1"], 1e-5, residual)
            qkv = small_m_linear(h, p["qkv"])
        rotary_qk_(qkv, cos, sin, num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD,
                   kv_cache=caches[i], slot_mapping=batch.slot_mapping)
        q = qkv[:, :HEADS * HEAD].view(1, HEADS, HEAD)
        attn = paged_attention(q, caches[i], batch.query_start_loc, batch.seq_lens,
                               batch.block_tables, max_query_len=1, scale=HEAD ** -0.5,
                               split_counters=counters)
        h = small_m_linear(attn.reshape(1, HEADS * HEAD), p["o"])
        if i % 2 == 0:
            gate_up, residual = norm_small_m_linear(h, residual, p["ln2"], 1e-5, p["gate_up"])
            x = silu_mul_small_m_linear(gate_up, p["down"])
        else:
            h, residual = rms_norm(h, p["ln2"], 1e-5, residual)
            x = small_m_linear(silu_and_mul(small_m_linear(h, p["gate_up"])), p["down"])
    return x + residual


@needs_hopper
def test_a_graph_of_pdl_kernels_reads_each_finished_output(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [_layer_weights(g) for _ in range(LAYERS)]
    batch = make_paged_batch([(300, 1)], num_heads=HEADS, num_kv_heads=KV_HEADS,
                             head_size=HEAD, block_size=16, dtype=torch.bfloat16,
                             device="cuda", seed=1)
    caches = torch.stack([batch.kv_cache] * LAYERS)  # one cache per layer
    cos = torch.randn(1, HEAD, device="cuda", generator=g)
    sin = torch.randn(1, HEAD, device="cuda", generator=g)
    counters = split_counters(1, KV_HEADS, "cuda")
    inputs = [torch.randn(1, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
              for _ in range(6)]
    cache0 = caches.clone()

    monkeypatch.setenv(pdl.ENV, "0")
    expected = []
    for x in inputs:
        caches.copy_(cache0)
        expected.append(_layers(x, layers, batch, caches, cos, sin, counters))
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.pdl_enabled(torch.device("cuda"))
    static_x = inputs[0].clone()
    _layers(static_x, layers, batch, caches, cos, sin, counters)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _layers(static_x, layers, batch, caches, cos, sin, counters)
    for x, want in zip(inputs, expected, strict=True):
        static_x.copy_(x)
        caches.copy_(cache0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, want)
    assert int(counters.abs().sum()) == 0  # the fused merge left its counters zeroed


@pytest.fixture(scope="module")
def llama8b_shape(tmp_path_factory) -> Path:
    return write_copy_circuit_model(tmp_path_factory.mktemp("llama8b_pdl"), llama_config(2),
                                    device="cuda")


@needs_hopper
@pytest.mark.parametrize("backend", backend_params("triton", "flashinfer"))
def test_greedy_tokens_equal_with_pdl_on_and_off(llama8b_shape, backend, monkeypatch):
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(0, 128256, (n,), generator=g).tolist() for n in (1, 17, 100, 300, 33)]
    prompt_sets = [batch[2:3], batch]
    monkeypatch.setenv(pdl.ENV, "1")
    on, _ = generate_greedy(llama8b_shape, backend, prompt_sets)
    monkeypatch.setenv(pdl.ENV, "0")
    off, _ = generate_greedy(llama8b_shape, backend, prompt_sets)
    assert on == off
