"""The ``cpu`` attention backend: decode-only steps, and causal steps of short queries
a row per token, through lmkit's C kernel, every other step exactly as the torch
reference.

Two backends, ``cpu`` and ``torch``, run the same steps on copies of one float32 cache:
decode steps must agree within float32 rounding (and store the same K/V bit for bit),
other steps bit for bit. The conformance suite (test_conformance_builtins) checks the
backend against the float64 oracle as well.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from lmkit_kernels.cpu.paged_decode import (  # noqa: E402
    decode_attention_kernel,
    paged_decode_attention,
    paged_decode_unavailable_reason,
)
from lmkit_plugins.attention.cpu_backend import CpuAttention  # noqa: E402
from lmkit_plugins.attention.torch_ref import TorchAttention  # noqa: E402
from test_torch_attention import dense_reference, make_metadata  # noqa: E402

F32 = torch.float32


@pytest.fixture
def kernel():
    if decode_attention_kernel() is None:
        pytest.skip(f"C paged decode kernel not available: {paged_decode_unavailable_reason()}")


def _pair(heads, kv_heads, head_size, block_size, window=None):
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_size=head_size,
              scale=head_size ** -0.5, dtype=F32, device=torch.device("cpu"),
              block_size=block_size, sliding_window=window)
    return CpuAttention(**kw), TorchAttention(**kw)


class TwinCaches:
    """Requests with histories in two identical caches, one per backend."""

    def __init__(self, cpu, ref, num_blocks=96, seed=0):
        self.cpu, self.ref = cpu, ref
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = torch.randn(cpu.kv_cache_shape(num_blocks), generator=self.gen)
        self.ref_cache = self.cache.clone()
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.lens: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}

    def step(self, work):
        """``work``: (request, query_len); returns both outputs and the metadata."""
        b = self.cpu
        reqs, tables = [], []
        for rid, q_len in work:
            ctx = self.lens.get(rid, 0)
            table = self.tables.setdefault(rid, [])
            while len(table) * b.block_size < ctx + q_len:
                table.append(self.free.pop())
            reqs.append((ctx, q_len))
            tables.append(table)
            self.lens[rid] = ctx + q_len
        n = sum(q for _, q in work)
        md = make_metadata(reqs, b.block_size, tables)
        # q/k/v as the model passes them: head views of one fused projection output
        qkv = torch.randn(n, (b.num_heads + 2 * b.num_kv_heads) * b.head_size, generator=self.gen)
        q = qkv[:, :b.num_heads * b.head_size].view(n, b.num_heads, b.head_size)
        k = qkv[:, q.shape[1] * b.head_size:][:, :b.num_kv_heads * b.head_size].view(
            n, b.num_kv_heads, b.head_size)
        v = qkv[:, -b.num_kv_heads * b.head_size:].view(n, b.num_kv_heads, b.head_size)
        self.cpu.plan(md)
        self.ref.plan(md)
        out = self.cpu.run(0, q, k, v, self.cache)
        ref = self.ref.run(0, q, k, v, self.ref_cache)
        return out, ref, md, (q, k, v)


# the grouped AVX-512 kernels (9/3 x 64, 4/4 x 128) at their largest groups (16/2 x 32:
# 8 per KV head; 4/2 x 128: 2) and the plain loop (80: no group kernel; 4/1 x 128: 4 per
# KV head need too many accumulators; 40: not a multiple of 16)
@pytest.mark.parametrize("heads,kv_heads,head_size", [(9, 3, 64), (4, 4, 128), (8, 1, 80),
                                                   (4, 2, 40), (16, 2, 32), (4, 2, 128),
                                                   (4, 1, 128)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_steps_match_the_reference(kernel, heads, kv_heads, head_size, block_size,
                                          window):
    cpu, ref = _pair(heads, kv_heads, head_size, block_size, window)
    world = TwinCaches(cpu, ref)
    out, expect, _, _ = world.step([(0, 20), (1, 3), (2, 33)])  # prefill: the reference
    assert cpu._decode is None and torch.equal(out, expect)
    for work in ([(0, 1), (1, 1), (2, 1)], [(1, 1)], [(2, 1), (0, 1)], [(3, 1)]):
        out, expect, _, _ = world.step(work)
        assert cpu._decode is not None  # the kernel ran
        assert out.shape == expect.shape
        torch.testing.assert_close(out, expect, rtol=2e-5, atol=2e-5)
        assert torch.equal(world.cache, world.ref_cache)  # K/V stored identically


def test_decode_against_dense_attention_with_long_contexts(kernel):
    cpu, ref = _pair(6, 2, 64, 16)
    world = TwinCaches(cpu, ref, num_blocks=200)
    world.step([(0, 700), (1, 1)])
    # the cache rows are the history: read them back for a dense check
    out, _, md, (q, _, _) = world.step([(0, 1), (1, 1)])
    for r, rid in enumerate((0, 1)):
        length = world.lens[rid]
        slots = [world.tables[rid][p // 16] * 16 + p % 16 for p in range(length)]
        keys = world.cache[0].view(-1, 2, 64)[slots]
        values = world.cache[1].view(-1, 2, 64)[slots]
        expect = dense_reference(q[r:r + 1].double(), keys.double(), values.double(),
                                 length - 1, cpu.scale, None)
        torch.testing.assert_close(out[r:r + 1].double(), expect, rtol=1e-5, atol=1e-5)


def test_a_requests_output_does_not_depend_on_the_batch_or_threads(kernel):
    cpu, ref = _pair(9, 3, 64, 16)
    world = TwinCaches(cpu, ref)
    world.step([(0, 40), (1, 50)])
    md = make_metadata([(40, 1), (50, 1)], 16, [world.tables[0], world.tables[1]])
    q = torch.randn(2, 9, 64)
    k, v = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    both = paged_decode_attention(q, k, v, world.cache, md.slot_mapping, md.block_tables,
                                  md.seq_lens, scale=cpu.scale)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = paged_decode_attention(q, k, v, world.cache, md.slot_mapping,
                                        md.block_tables, md.seq_lens, scale=cpu.scale)
    finally:
        torch.set_num_threads(threads)
    alone = paged_decode_attention(q[1:], k[1:], v[1:], world.cache, md.slot_mapping[1:],
                                   md.block_tables[1:], md.seq_lens[1:], scale=cpu.scale)
    assert torch.equal(both, single) and torch.equal(both[1:], alone)


def test_mixed_and_prefill_steps_are_the_reference_bit_for_bit(kernel):
    cpu, ref = _pair(4, 2, 64, 16)
    world = TwinCaches(cpu, ref)
    world.step([(0, 9), (1, 17)])
    # decodes mixed with prefills, one longer than the flattened queries (16 tokens)
    out, expect, _, _ = world.step([(0, 1), (1, 5), (2, 17)])
    assert cpu._decode is None and torch.equal(out, expect)


@pytest.mark.parametrize("window", [None, 5])
def test_short_multi_token_queries_run_a_decode_row_per_token(kernel, window):
    """A causal step of at most 16 query tokens per request (a speculative verification,
    a short prompt, mixed with decodes) runs through the decode kernel, a row per token:
    within float32 rounding of the reference, the same K/V stored, and each row exactly
    what a decode step at that token's position computes."""
    cpu, ref = _pair(4, 2, 64, 16, window)
    world = TwinCaches(cpu, ref)
    world.step([(0, 9), (1, 17)])
    before, table = world.cache.clone(), list(world.tables[0])
    out, expect, _, (q, k, v) = world.step([(0, 4), (1, 1), (2, 16)])
    assert cpu._decode is not None and cpu._decode.multi_token
    torch.testing.assert_close(out, expect, rtol=2e-5, atol=2e-5)
    assert torch.equal(world.cache, world.ref_cache)
    assert cpu.paged_decode_args() is None  # callers opt in to rows per token
    slots, tables, lens = cpu.paged_decode_args(multi_token=True)
    assert lens.tolist() == [10, 11, 12, 13, 18] + list(range(1, 17))
    assert tables.shape[0] == slots.shape[0] == 21
    alone, _ = _pair(4, 2, 64, 16, window)
    for j in range(4):  # request 0's tokens as decode steps, one at a time
        alone.plan(make_metadata([(9 + j, 1)], 16, [table]))
        row = alone.run(0, q[j:j + 1], k[j:j + 1], v[j:j + 1], before)
        assert torch.equal(row[0], out[j])


def test_head_views_the_kernel_cannot_read_take_the_reference(kernel):
    cpu, ref = _pair(4, 2, 64, 16)
    world = TwinCaches(cpu, ref)
    world.step([(0, 9), (1, 17)])
    md = make_metadata([(9, 1), (17, 1)], 16, [world.tables[0], world.tables[1]])
    q = torch.randn(2, 64, 4).transpose(1, 2)  # [2, 4, 64] with strided head dims
    k, v = torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    cpu.plan(md)
    ref.plan(md)
    assert cpu._decode is not None
    assert torch.equal(cpu.run(0, q, k, v, world.cache), ref.run(0, q, k, v, world.ref_cache))


def test_bfloat16_or_cuda_backends_keep_the_reference_path():
    backend = CpuAttention(num_heads=4, num_kv_heads=2, head_size=64, scale=0.125,
                           dtype=torch.bfloat16, device=torch.device("cpu"), block_size=16)
    assert backend._decode_kernel is None


def test_checked_entry_refuses_what_it_does_not_take(kernel):
    cache = torch.zeros(2, 4, 16, 2, 64)
    q, k = torch.randn(1, 4, 64), torch.randn(1, 2, 64)
    slots = torch.tensor([3])
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="float32"):
        paged_decode_attention(q.double(), k.double(), k.double(), cache, slots, tables, lens,
                               scale=1.0)
    with pytest.raises(ValueError, match="int64"):
        paged_decode_attention(q, k, k, cache, slots.int(), tables, lens, scale=1.0)
    with pytest.raises(ValueError, match="do not fit together"):
        paged_decode_attention(q, torch.randn(1, 3, 64), torch.randn(1, 3, 64), cache, slots,
                               tables, lens, scale=1.0)
    with pytest.raises(ValueError, match="exceeds its block table"):
        paged_decode_attention(q, k, k, cache, slots, tables,
                               torch.tensor([33], dtype=torch.int32), scale=1.0)
    with pytest.raises(ValueError, match="seq_len >= 1"):
        paged_decode_attention(q, k, k, cache, slots, tables,
                               torch.tensor([0], dtype=torch.int32), scale=1.0)


def test_the_switch_keeps_multi_token_queries_on_the_reference(kernel, monkeypatch):
    """``LMKIT_CPU_FLAT_QUERIES=0`` (read when the backend is built) runs short multi-token
    steps as the reference, bit for bit; decode-only steps keep the kernel."""
    from lmkit_plugins.attention.cpu_backend import FLAT_QUERIES_ENV

    monkeypatch.setenv(FLAT_QUERIES_ENV, "0")
    cpu, ref = _pair(4, 2, 64, 16)
    monkeypatch.delenv(FLAT_QUERIES_ENV)
    world = TwinCaches(cpu, ref)
    world.step([(0, 9), (1, 17)])
    out, expect, _, _ = world.step([(0, 4), (1, 1)])
    assert cpu._decode is None and torch.equal(out, expect)
    world.step([(0, 1), (1, 1)])
    assert cpu._decode is not None
