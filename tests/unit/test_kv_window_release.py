"""Blocks behind a sliding window: released while a request runs, when every layer slides."""

from __future__ import annotations

import pytest
import torch
from lmkit.api import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from lmkit.api.kv_cache_spec import kv_window
from lmkit.api.request import Request
from lmkit.api.sampling_params import SamplingParams
from lmkit.kv_cache.block_pool import NULL_BLOCK_ID
from lmkit.kv_cache.manager import KVCacheManager
from lmkit_plugins.attention.torch_ref import TorchAttention

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=32), cache_salt=None)


def decode(m: KVCacheManager, r: Request) -> None:
    assert m.allocate_slots(r, 1) is not None
    r.num_computed_tokens += 1
    r.append_output_token_ids([7])


def test_blocks_behind_the_window_are_released_and_the_rest_freed_once():
    m = KVCacheManager(32, BS, sliding_window=6)
    r = req("a", list(range(10)))  # 3 blocks
    hits, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, 10, new_computed_blocks=hits) is not None
    r.num_computed_tokens = 10
    r.append_output_token_ids([7])
    table = m.get_block_ids(r)
    free = m.num_free_blocks
    decode(m, r)  # the query at 10 reads keys 5..10: block 0 (keys 0-3) is behind
    assert m.get_block_ids(r)[:3] == [NULL_BLOCK_ID, *table[1:3]]
    assert m.num_free_blocks == free + 1
    for _ in range(4):  # queries at 11..14; from 13 on keys 8.. only: block 1 goes too
        decode(m, r)
    assert m.get_block_ids(r)[:2] == [NULL_BLOCK_ID] * 2
    assert m.num_free_blocks == free + 2 - 1  # (one new block for position 12..15)
    m.free(r)  # no double free of the released blocks
    assert m.num_free_blocks == m.block_pool.num_usable_blocks


def test_released_blocks_stay_prefix_cache_hits():
    m = KVCacheManager(32, BS, sliding_window=6)
    prompt = list(range(100, 110))
    a = req("a", prompt)
    hits, _ = m.get_computed_blocks(a)
    m.allocate_slots(a, 10, new_computed_blocks=hits)
    a.num_computed_tokens = 10
    a.append_output_token_ids([7])
    first = m.get_block_ids(a)[0]
    decode(m, a)
    assert m.get_block_ids(a)[0] == NULL_BLOCK_ID
    blocks, num_hit = m.get_computed_blocks(req("b", prompt + [1]))
    assert num_hit == 8 and blocks[0].block_id == first


def test_without_a_window_nothing_is_released():
    m = KVCacheManager(32, BS)
    r = req("a", list(range(10)))
    hits, _ = m.get_computed_blocks(r)
    m.allocate_slots(r, 10, new_computed_blocks=hits)
    r.num_computed_tokens = 10
    r.append_output_token_ids([7])
    for _ in range(8):
        decode(m, r)
    assert NULL_BLOCK_ID not in m.get_block_ids(r)


def _backend(window: int | None) -> TorchAttention:
    return TorchAttention(num_heads=2, num_kv_heads=1, head_size=8, scale=1.0,
                          dtype=torch.float32, device=torch.device("cpu"), block_size=BS,
                          sliding_window=window)


@pytest.mark.parametrize("windows, expected", [
    ((4096,), 4096), ((16, 32), 32), ((16, None), None), ((None,), None), ((), None)])
def test_kv_window_is_the_widest_when_every_group_slides(windows, expected):
    groups = [KVCacheGroup(SlidingWindowSpec(window=w) if w else FullAttentionSpec(), (i,),
                           _backend(w)) for i, w in enumerate(windows)]
    assert kv_window(groups) == expected
