"""The ``flash_attn`` backend's wiring, on the CPU: the attention conformance suite runs
the backend against a stand-in for ``flash_attn.cute`` that makes FlashAttention-4's
argument checks (``flash_attn/cute/interface.py``: int32 ``page_table`` with a
contiguous last dimension, ``seqused_k`` per request, paged K/V as ``[num_pages,
page_size, num_kv_heads, head_dim]``, no ``cu_seqlens_k`` with a page table) and its
documented maths in torch (causal and window masks aligned to the end of the keys,
query head ``h`` reading KV head ``h // group``, rows with no keys zero).

The same for FA3 (``flash_attn_interface.flash_attn_with_kvcache``) and FA2
(``flash_attn.flash_attn_varlen_func`` with ``block_table`` and ``cu_seqlens_k``, pages of
256), whose stand-ins follow those libraries' signatures. What it proves: the plan's views,
FA2's cumulative contexts, the window conversion, GQA, padding and the K/V write are
wired as the libraries document them. What it cannot: the library's kernels
themselves (tests/gpu and bench/gpu_check_flash_attn.sh run those). New K/V go through
lmkit's Triton ``reshape_and_cache`` in Triton's CPU interpreter (for FA2's 256-token pages,
see ``interpreted_write_of_one_row``).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter()

import torch  # noqa: E402
from lmkit.api import Caps, Spec  # noqa: E402
from lmkit.testing.attention import check_attention_backend  # noqa: E402
from lmkit_plugins.attention import FlashAttnAttentionOptions  # noqa: E402
from lmkit_plugins.attention.flash_attn_backend import FlashAttnAttention  # noqa: E402

MATHS = '''
"""Test stand-in: FlashAttention's paged varlen maths in torch (test_flash_attn_wiring)."""
import torch

CALLS = []


def paged_attention(q, k, v, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, left, right, generation):
    """The checks the libraries make, then the maths. ``left``/``right``: None = no bound."""
    assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    batch = cu_seqlens_q.shape[0] - 1
    assert page_table.shape[0] == batch and seqused_k.shape == (batch,)
    for t in (cu_seqlens_q, seqused_k):
        assert t.dtype == torch.int32 and t.stride(0) == 1
    num_pages, page_size, hkv, d = k.shape
    assert v.shape == k.shape and q.shape[1] % hkv == 0 and q.shape[2] == d
    assert q.dtype == k.dtype == v.dtype
    cu, used = cu_seqlens_q.tolist(), seqused_k.tolist()
    assert q.shape[0] == cu[-1], "q rows past the last request"
    assert max(b - a for a, b in zip(cu, cu[1:])) <= max_seqlen_q
    assert max(used) <= max_seqlen_k <= page_table.shape[1] * page_size
    if causal:
        right = 0
    group = q.shape[1] // hkv
    out = torch.zeros_like(q)
    for b in range(batch):
        sq, sk = cu[b + 1] - cu[b], used[b]
        if sq == 0 or sk == 0:
            continue
        pages = page_table[b, : -(-sk // page_size)].long()
        keys = k[pages].reshape(-1, hkv, d)[:sk].float().repeat_interleave(group, 1)
        values = v[pages].reshape(-1, hkv, d)[:sk].float().repeat_interleave(group, 1)
        q_pos = torch.arange(sq)[:, None] + sk - sq  # aligned to the end of the keys
        k_pos = torch.arange(sk)[None, :]
        visible = torch.ones(sq, sk, dtype=torch.bool)
        if right is not None:
            visible &= k_pos <= q_pos + right
        if left is not None:
            visible &= k_pos >= q_pos - left
        scores = torch.einsum("qhd,khd->hqk", q[cu[b]:cu[b + 1]].float(), keys) * softmax_scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1))  # no keys: zero
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    CALLS.append((generation, left))
    return out
'''

FA4 = '''
from fa_stand_in_maths import paged_attention


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None,
                           seqused_q=None, seqused_k=None, gather_kv_indices=None,
                           page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0,
                           num_splits=1, pack_gqa=None, **unused):
    assert cu_seqlens_k is None and page_table is not None and seqused_q is None
    out = paged_attention(q, k, v, cu_seqlens_q, seqused_k, page_table, max_seqlen_q,
                          max_seqlen_k, softmax_scale, causal, *window_size, "fa4")
    return out, None
'''

FA3 = '''
import torch
from fa_stand_in_maths import paged_attention


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                            cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1),
                            attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None,
                            sm_margin=0, return_softmax_lse=False):
    assert k is None and v is None and page_table is not None
    left, right = (None if w < 0 else w for w in window_size)
    bound = page_table.shape[1] * k_cache.shape[1]
    return paged_attention(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, page_table,
                           max_seqlen_q, bound, softmax_scale, causal, left, right, "fa3")
'''

FA2 = '''
import torch
from fa_stand_in_maths import paged_attention


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    assert block_table is not None and k.shape[1] % 256 == 0
    assert cu_seqlens_k.dtype == torch.int32 and cu_seqlens_k.shape == cu_seqlens_q.shape
    assert int(cu_seqlens_k[0]) == 0
    left, right = (None if w < 0 else w for w in window_size)
    seqused_k = torch.diff(cu_seqlens_k).to(torch.int32)
    return paged_attention(q, k, v, cu_seqlens_q, seqused_k, block_table, max_seqlen_q,
                           max_seqlen_k, softmax_scale, causal, left, right, "fa2")
'''


@pytest.fixture
def stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Stand-ins for all three generations on ``sys.path`` (removed again afterwards):
    ``flash_attn.cute`` (FA4), ``flash_attn_interface`` (FA3), ``flash_attn`` with the
    extension module ``flash_attn_2_cuda`` (FA2)."""
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "fa_stand_in_maths.py").write_text(MATHS)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text(FA4)
    (tmp_path / "flash_attn" / "__init__.py").write_text(FA2)
    (tmp_path / "flash_attn_2_cuda.py").write_text("")
    (tmp_path / "flash_attn_interface.py").write_text(FA3)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield sys.modules
    for name in ("flash_attn.cute", "flash_attn", "flash_attn_interface", "fa_stand_in_maths"):
        sys.modules.pop(name, None)


def interpreted_write_of_one_row(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The backend's K/V write: Triton's ``reshape_and_cache`` on the step's first row
    (all its argument checks, the interpreted kernel at this page size), the rest by
    its torch reference ``reshape_and_cache_ref``. The interpreter runs one program per
    token: with FA2's 256-token pages the suite's workloads write about 14,000 tokens,
    a minute of interpreted copies that prove nothing FA4's run (same write call, same
    kernel) and ``test_reshape_and_cache`` (kernel == reference, 256-token pages too)
    do not."""
    from lmkit_kernels.cache_write import reshape_and_cache
    from lmkit_kernels.reference import reshape_and_cache_ref
    from lmkit_plugins.attention import flash_attn_backend

    rows: list[int] = []

    def write(key, value, kv_cache, slot_mapping):
        reshape_and_cache(key, value, kv_cache, slot_mapping[:1])
        reshape_and_cache_ref(key, value, kv_cache, slot_mapping)
        rows.append(slot_mapping.shape[0])

    monkeypatch.setattr(flash_attn_backend, "reshape_and_cache", write)
    return rows


class HopperOnCpu(FlashAttnAttention):
    """The backend, told it runs on a compute-capability 9.0 device."""

    def device_capability(self) -> tuple[int, int]:
        return (9, 0)


@pytest.mark.parametrize(("generation", "block_size"), [
    ("fa4", 16),
    pytest.param("fa3", 16, marks=pytest.mark.slow),
    pytest.param("fa2", 256, marks=pytest.mark.slow),  # 256-token pages
])
def test_flash_attn_wiring_passes_the_conformance_suite(stand_ins, generation, block_size,
                                                        monkeypatch):
    written = interpreted_write_of_one_row(monkeypatch) if block_size == 256 else None
    spec = Spec(name="flash_attn", target=lambda: HopperOnCpu,
                options=FlashAttnAttentionOptions, caps=Caps(
                    {"multi_token_query", "prefix_caching", "chunked_prefill", "sliding_window"},
                    {"device": {"cpu"}, "dtype": {"float16"}, "head_size": {64},
                     "block_size": {block_size}}))
    results = check_attention_backend(spec, {"generation": generation})
    assert [p for p, r in results.items() if r != "passed"] == [
        "logits soft cap", "tree mask", "fp8 KV cache", "cuda graphs",
        "in-place decode metadata"], results
    calls = stand_ins["fa_stand_in_maths"].CALLS
    assert {g for g, _ in calls} == {generation}
    assert {left for _, left in calls} == {None, 6}  # whole context; sliding window 7
    assert written is None or written  # the writes went through interpreted_write_of_one_row


def test_padding_rows_are_zero_and_generation_is_fa4(stand_ins):
    from lmkit.api import AttentionMetadata
    from lmkit_kernels.random_batch import make_paged_batch

    batch = make_paged_batch([(40, 1), (0, 9)], num_heads=8, num_kv_heads=2, head_size=64,
                             block_size=16, dtype=torch.float16, extra_rows=3)
    backend = HopperOnCpu(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125,
                          dtype=torch.float16, device=torch.device("cpu"), block_size=16)
    assert backend.generation == "fa4"
    backend.plan(AttentionMetadata(**batch.metadata_kwargs()))
    out = backend.run(0, batch.q, batch.k, batch.v, batch.kv_cache.clone())
    assert out.shape == batch.q.shape
    assert torch.all(out[batch.num_tokens:] == 0) and out[: batch.num_tokens].abs().sum() > 0
