"""The torch reference paged-attention backend against dense causal attention."""

from __future__ import annotations

import math

import pytest
import torch
from lmkit.api import AttentionMetadata
from lmkit_plugins.attention.torch_ref import TorchAttention

DTYPE = torch.float64
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def make_backend(num_heads, num_kv_heads, head_size, block_size, sliding_window=None,
                 device=torch.device("cpu"), logits_soft_cap=None):
    return TorchAttention(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                          scale=head_size ** -0.5, dtype=DTYPE, device=device,
                          block_size=block_size, sliding_window=sliding_window,
                          logits_soft_cap=logits_soft_cap)


def make_metadata(reqs, block_size, block_tables, device=torch.device("cpu")):
    """``reqs``: list of (context_len, query_len); ``block_tables``: per request list."""
    q_lens = [q for _, q in reqs]
    seq_lens = [c + q for c, q in reqs]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    width = max(len(t) for t in block_tables)
    tables = torch.zeros(len(reqs), width, dtype=torch.int32)
    for i, t in enumerate(block_tables):
        tables[i, :len(t)] = torch.tensor(t)
    slots = []
    for (ctx, q), table in zip(reqs, block_tables, strict=True):
        for pos in range(ctx, ctx + q):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_reqs=len(reqs), num_actual_tokens=sum(q_lens), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl.to(device), seq_lens=seq.to(device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq)


def dense_reference(q, k_all, v_all, ctx, scale, window, soft_cap=None):
    """q: [q_len, H, D]; k_all/v_all: [ctx + q_len, Hkv, D] -> [q_len, H, D]."""
    group = q.shape[1] // k_all.shape[1]
    k = k_all.repeat_interleave(group, dim=1)
    v = v_all.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    q_pos = torch.arange(q.shape[0], device=q.device)[:, None] + ctx
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class PagedWorld:
    """A KV cache with requests whose earlier tokens are already in it."""

    def __init__(self, backend, num_blocks, seed=0):
        self.backend = backend
        self.device = backend.device
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = torch.zeros(backend.kv_cache_shape(num_blocks), dtype=DTYPE,
                                 device=self.device)
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.tables: dict[int, list[int]] = {}

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.gen, dtype=DTYPE).to(self.device)

    def prefill_cached(self, rid, length):
        """Put ``length`` tokens of request ``rid`` into the cache directly (a cached prefix)."""
        b = self.backend
        k, v = self.rand(length, b.num_kv_heads, b.head_size), self.rand(
            length, b.num_kv_heads, b.head_size)
        self.history[rid] = (k, v)
        self.tables[rid] = []
        self._ensure_blocks(rid, length)
        for pos in range(length):
            blk = self.tables[rid][pos // b.block_size]
            self.cache[0, blk, pos % b.block_size] = k[pos]
            self.cache[1, blk, pos % b.block_size] = v[pos]

    def _ensure_blocks(self, rid, length):
        need = -(-length // self.backend.block_size)
        while len(self.tables[rid]) < need:
            self.tables[rid].append(self.free.pop())

    def step(self, work):
        """Run one step: ``work`` is a list of (rid, query_len); compare with dense."""
        b = self.backend
        reqs, tables, qs, ks, vs = [], [], [], [], []
        for rid, q_len in work:
            if rid not in self.history:
                self.history[rid] = (self.rand(0, b.num_kv_heads, b.head_size),
                                     self.rand(0, b.num_kv_heads, b.head_size))
                self.tables[rid] = []
            ctx = self.history[rid][0].shape[0]
            self._ensure_blocks(rid, ctx + q_len)
            reqs.append((ctx, q_len))
            tables.append(self.tables[rid])
            qs.append(self.rand(q_len, b.num_heads, b.head_size))
            ks.append(self.rand(q_len, b.num_kv_heads, b.head_size))
            vs.append(self.rand(q_len, b.num_kv_heads, b.head_size))
        md = make_metadata(reqs, b.block_size, tables, self.device)
        b.plan(md)
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        out = b.run(0, q, k, v, self.cache)
        assert out.shape == q.shape
        start = 0
        for (rid, q_len), (ctx, _), qi, ki, vi in zip(work, reqs, qs, ks, vs, strict=True):
            hk, hv = self.history[rid]
            k_all, v_all = torch.cat([hk, ki]), torch.cat([hv, vi])
            self.history[rid] = (k_all, v_all)
            ref = dense_reference(qi, k_all, v_all, ctx, b.scale, b.sliding_window,
                                  b.logits_soft_cap)
            torch.testing.assert_close(out[start:start + q_len], ref, rtol=1e-9, atol=1e-9)
            start += q_len


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_prefill_then_decodes(block_size, head_size, heads, device):
    backend = make_backend(*heads, head_size, block_size, device=device)
    world = PagedWorld(backend, num_blocks=256)
    world.step([(0, 13), (1, 40), (2, 1)])
    for _ in range(3):
        world.step([(0, 1), (1, 1), (2, 1)])


@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_over_cached_prefix(block_size, device):
    world = PagedWorld(make_backend(8, 2, 64, block_size, device=device), num_blocks=300)
    world.prefill_cached(0, 37)
    world.prefill_cached(1, 32)
    world.step([(0, 11), (1, 20), (2, 9)])


@pytest.mark.parametrize("block_size", [16, 32])
def test_chunked_prefill_mixed_with_decodes(block_size, device):
    world = PagedWorld(make_backend(6, 3, 64, block_size, device=device), num_blocks=128)
    world.step([(0, 5), (1, 3)])
    # decodes first, then a chunk of a long prompt, then decodes after it (unordered)
    world.step([(0, 1), (2, 17), (1, 1)])
    world.step([(2, 23), (0, 1), (1, 1), (3, 4)])
    world.step([(1, 1), (2, 1), (3, 6), (0, 1)])


def test_multi_token_decode_queries(device):
    # speculative decoding: several query tokens per request on top of a long context
    world = PagedWorld(make_backend(8, 2, 64, 16, device=device), num_blocks=64)
    world.prefill_cached(0, 50)
    world.prefill_cached(1, 21)
    world.step([(0, 4), (1, 3)])
    world.step([(0, 1), (1, 5)])


@pytest.mark.parametrize("block_size", [1, 16])
def test_sliding_window(block_size, device):
    backend = make_backend(4, 2, 64, block_size, sliding_window=8, device=device)
    world = PagedWorld(backend, num_blocks=256)
    world.prefill_cached(0, 20)
    world.step([(0, 12), (1, 30), (2, 5)])
    world.step([(0, 1), (1, 1), (2, 7)])


def test_logits_soft_cap_with_sliding_window(device):
    # Gemma-2: scores capped at 1 (scaled scores of these inputs reach ~2, so it bites);
    # prefill, a cached prefix, decodes and a chunk in one step
    backend = make_backend(4, 2, 16, 4, sliding_window=6, device=device, logits_soft_cap=1.0)
    world = PagedWorld(backend, num_blocks=64)
    world.prefill_cached(0, 9)
    world.step([(0, 5), (1, 11), (2, 1)])
    world.step([(0, 1), (1, 1), (2, 7)])
    q, k = world.rand(3, 4, 16), world.rand(3, 2, 16)
    assert (torch.einsum("qhd,khd->hqk", q[:, :2], k) * 0.25).abs().max() > 1


def test_single_request_full_batch_fast_path(device):
    world = PagedWorld(make_backend(4, 1, 64, 16, device=device), num_blocks=32)
    world.step([(0, 33)])
    world.step([(0, 1)])
    world.step([(0, 1), (1, 1)])


def test_writes_kv_through_slot_mapping():
    backend = make_backend(2, 2, 64, 4)
    cache = torch.zeros(backend.kv_cache_shape(8), dtype=DTYPE)
    md = make_metadata([(0, 3)], 4, [[5]])
    backend.plan(md)
    k = torch.randn(3, 2, 64, dtype=DTYPE)
    v = torch.randn(3, 2, 64, dtype=DTYPE)
    backend.run(0, torch.randn(3, 2, 64, dtype=DTYPE), k, v, cache)
    torch.testing.assert_close(cache[0, 5, :3], k)
    torch.testing.assert_close(cache[1, 5, :3], v)
    assert cache[:, :5].abs().sum() == 0 and cache[:, 6:].abs().sum() == 0


def test_float32_matches_float64_reference():
    backend = TorchAttention(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125,
                             dtype=torch.float32, device=torch.device("cpu"), block_size=16)
    cache = torch.zeros(backend.kv_cache_shape(16), dtype=torch.float32)
    md = make_metadata([(0, 20), (0, 7)], 16, [[3, 4], [9]])
    backend.plan(md)
    q, k, v = (torch.randn(27, h, 64) for h in (8, 2, 2))
    out = backend.run(0, q, k, v, cache)
    ref0 = dense_reference(q[:20].double(), k[:20].double(), v[:20].double(), 0, 0.125, None)
    ref1 = dense_reference(q[20:].double(), k[20:].double(), v[20:].double(), 0, 0.125, None)
    torch.testing.assert_close(out.double(), torch.cat([ref0, ref1]), rtol=1e-5, atol=1e-5)


def test_run_before_plan_is_an_error():
    backend = make_backend(2, 2, 64, 4)
    x = torch.zeros(1, 2, 64, dtype=DTYPE)
    with pytest.raises(RuntimeError, match="before plan"):
        backend.run(0, x, x, x, torch.zeros(backend.kv_cache_shape(1), dtype=DTYPE))
