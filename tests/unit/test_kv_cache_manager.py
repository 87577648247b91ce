"""KVCacheManager: block tables, prefix-cache hits and counters, slot allocation."""

from __future__ import annotations

from lmkit.api.request import Request
from lmkit.api.sampling_params import SamplingParams
from lmkit.kv_cache.manager import KVCacheManager

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None, **params) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8, **params), cache_salt=salt)


def prefill(m: KVCacheManager, r: Request) -> list[int]:
    """Admit ``r`` and allocate its whole prompt in one step (as the scheduler does)."""
    hits, num_hit = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - num_hit, new_computed_blocks=hits)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    return new


def test_second_request_hits_shared_prefix_blocks():
    m = KVCacheManager(64, BS)
    prefix = list(range(100, 123))  # 23 tokens: 5 full blocks
    a = req("a", prefix + [1, 2, 3, 4, 5])
    prefill(m, a)
    m.free(a)
    b = req("b", prefix + [9, 9, 9])
    blocks, num_hit = m.get_computed_blocks(b)
    assert len(blocks) == len(prefix) // BS == 5 and num_hit == 20
    assert [blk.block_hash for blk in blocks] == a.block_hashes[:5]
    assert m.prefix_cache_queries == a.num_tokens + b.num_tokens
    assert m.prefix_cache_hits == 20
    new = m.allocate_slots(b, b.num_tokens - num_hit, new_computed_blocks=blocks)
    assert m.get_block_ids(b)[:5] == [blk.block_id for blk in blocks]
    assert len(new) == 2  # 26 tokens -> 7 blocks, 5 of them hits


def test_hit_never_covers_the_whole_prompt():
    m = KVCacheManager(64, BS)
    tokens = list(range(12))  # exactly 3 blocks
    a = req("a", tokens)
    prefill(m, a)
    m.free(a)
    blocks, num_hit = m.get_computed_blocks(req("b", tokens))
    assert len(blocks) == 2 and num_hit == 8  # the last block is recomputed
    blocks, num_hit = m.get_computed_blocks(req("c", tokens + [77]))
    assert len(blocks) == 3 and num_hit == 12


def test_same_step_requests_share_blocks_with_refcounts():
    m = KVCacheManager(64, BS)
    prefix = list(range(16))
    a, b = req("a", prefix + [1]), req("b", prefix + [2])
    prefill(m, a)  # a is still running when b is admitted
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 16
    m.allocate_slots(b, 1, new_computed_blocks=hits)
    assert m.get_block_ids(a)[:4] == m.get_block_ids(b)[:4]
    assert m.get_block_ids(a)[4] != m.get_block_ids(b)[4]
    assert all(blk.ref_cnt == 2 for blk in hits)
    m.free(a)
    assert all(blk.ref_cnt == 1 for blk in hits)
    m.free(b)
    assert m.usage == 0.0


def test_salt_and_prompt_logprobs_prevent_hits():
    m = KVCacheManager(64, BS)
    tokens = list(range(20))
    prefill(m, req("a", tokens, salt="x"))
    assert m.get_computed_blocks(req("b", tokens))[1] == 0
    assert m.get_computed_blocks(req("c", tokens, salt="y"))[1] == 0
    assert m.get_computed_blocks(req("d", tokens, salt="x"))[1] == 16
    assert m.get_computed_blocks(req("e", tokens, salt="x", prompt_logprobs=0))[1] == 0


def test_prefix_caching_off_hashes_and_hits_nothing():
    m = KVCacheManager(64, BS, enable_prefix_caching=False)
    a = req("a", list(range(20)))
    prefill(m, a)
    m.free(a)
    assert m.get_computed_blocks(req("b", list(range(20)))) == ([], 0)
    assert a.block_hashes == [] and m.prefix_cache_queries == 0


def test_allocation_fails_cleanly_when_the_pool_is_short():
    m = KVCacheManager(5, BS)  # 4 usable blocks
    a = req("a", list(range(10)))
    assert m.allocate_slots(a, 10) is not None  # 3 blocks
    b = req("b", list(range(50, 60)))
    assert m.allocate_slots(b, 10) is None
    assert m.get_block_ids(b) == [] and m.num_free_blocks == 1
    assert m.allocate_slots(b, 4) is not None


def test_free_hits_count_against_the_free_pool():
    m = KVCacheManager(5, BS)  # 4 usable blocks
    a = req("a", list(range(13)))
    prefill(m, a)  # 4 blocks, 3 full and cached
    m.free(a)
    b = req("b", list(range(12)) + [99, 98, 97, 96, 95])  # 3 hits + needs 2 more blocks
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 12
    assert m.allocate_slots(b, 5, new_computed_blocks=hits) is None  # 3 hits + 2 new > 4
    assert m.allocate_slots(b, 4, new_computed_blocks=hits) is not None  # 3 + 1 fits
    assert m.usage == 1.0


def test_blocks_cached_as_they_fill_and_evicted_tail_first():
    m = KVCacheManager(6, BS)  # 5 usable blocks
    a = req("a", list(range(6)))
    prefill(m, a)  # 2 blocks, the first full and cached
    assert len(m.block_pool.cached_blocks) == 1
    a.append_output_token_ids([6])  # decode: 7 tokens computed, second block not full
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    assert len(m.block_pool.cached_blocks) == 1
    a.append_output_token_ids([7])  # the second block fills with this step's token
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    assert len(m.block_pool.cached_blocks) == 2 and len(a.block_hashes) == 2
    a.append_output_token_ids([8])
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    first, second, third = m.req_to_blocks["a"]
    m.free(a)
    assert m.usage == 0.0
    # freed last-first: the tail is evicted before the shared prefix
    order = [b.block_id for b in m.block_pool.free_queue]
    assert order.index(third.block_id) < order.index(second.block_id) < order.index(first.block_id)
    m.allocate_slots(req("x", list(range(500, 512))), 12)  # 3 fresh blocks + ...
    m.allocate_slots(req("y", list(range(600, 604))), 4)  # ... 1 more evicts the second
    assert m.num_evictions == 1
    assert m.get_computed_blocks(req("z", list(range(9)) + [1]))[1] == 4  # the first survives


def test_lookahead_slots_are_reserved_and_clipped_to_max_model_len():
    m = KVCacheManager(64, BS, max_model_len=16)
    a = req("a", list(range(5)))
    m.allocate_slots(a, 5, num_lookahead_tokens=4)  # 9 slots -> 3 blocks
    assert len(m.get_block_ids(a)) == 3
    a.num_computed_tokens = 5
    m.allocate_slots(a, 6, num_lookahead_tokens=8)  # 19 slots clipped to 16 -> 4 blocks
    assert len(m.get_block_ids(a)) == 4
    assert m.allocate_slots(a, 1) == []  # room already there


def test_reset_prefix_cache_forgets_hits():
    m = KVCacheManager(64, BS)
    a = req("a", list(range(20)))
    prefill(m, a)
    m.free(a)
    assert m.reset_prefix_cache() == 5
    assert m.get_computed_blocks(req("b", list(range(20)))) == ([], 0)
