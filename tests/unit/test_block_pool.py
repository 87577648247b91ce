"""BlockPool (free queue, reference counts, LRU eviction, hash reuse) and block hashing."""

from __future__ import annotations

import hashlib

import pytest
from lmkit.api.request import Request
from lmkit.api.sampling_params import SamplingParams
from lmkit.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from lmkit.kv_cache.hashing import DEFAULT_SEED, hash_block_tokens, update_block_hashes


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# -- free queue ---------------------------------------------------------------------

def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    q.append(blocks[2])
    assert ids(q) == [0, 1, 3, 4, 2]
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])  # the tail
    q.remove(blocks[1])  # the head
    assert ids(q) == [3, 4] and len(q) == 2
    assert blocks[1].prev_free is None and blocks[1].next_free is None


def test_free_queue_popleft_on_empty_raises():
    q = FreeBlockQueue([])
    with pytest.raises(IndexError):
        q.popleft()


# -- pool: allocation and reference counts -----------------------------------------------

def test_null_block_is_reserved_and_never_handed_out():
    pool = BlockPool(4)
    assert pool.num_usable_blocks == 3 and pool.num_free_blocks == 3
    got = pool.get_new_blocks(3)
    assert 0 not in ids(got) and sorted(ids(got)) == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_refcounts_touch_and_free():
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2  # still held by someone
    pool.free_blocks([a, b])
    assert a.ref_cnt == b.ref_cnt == 0 and pool.num_free_blocks == 4
    assert pool.usage == 0.0
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([a])


def test_allocation_takes_least_recently_freed_first():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)  # 1, 2, 3, 4
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert ids(pool.free_queue) == [3, 1, 4, 2]
    assert ids(pool.get_new_blocks(2)) == [3, 1]


# -- pool: prefix cache ---------------------------------------------------------------------

def test_freed_cached_block_is_reusable_by_hash_until_evicted():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, h(1)) and pool.cache_block(b, h(2))
    pool.free_blocks([b, a])  # request order reversed: b is evicted first
    assert pool.get_cached_block(h(1)) is a and pool.get_cached_block(h(2)) is b
    # a hit takes a back out of the middle of the free queue
    pool.touch([a])
    assert a.ref_cnt == 1 and ids(pool.free_queue) == [b.block_id]
    # the next allocation evicts b: its hash is gone and counted
    (c,) = pool.get_new_blocks(1)
    assert c is b and c.block_hash is None and c.ref_cnt == 1
    assert pool.get_cached_block(h(2)) is None and pool.num_evictions == 1
    assert pool.get_cached_block(h(1)) is a


def test_cache_block_keeps_the_first_block_for_a_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, h(7))
    assert not pool.cache_block(b, h(7))  # same content computed twice
    assert not pool.cache_block(a, h(8))  # already registered
    assert b.block_hash is None and pool.get_cached_block(h(7)) is a


def test_caching_off_registers_nothing():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_block(a, h(1))
    assert pool.get_cached_block(h(1)) is None


def test_reset_prefix_cache_drops_every_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(h(1)) is None and a.block_hash is None and b.block_hash is None
    pool.get_new_blocks(2)
    assert pool.num_evictions == 0  # nothing left to evict


# -- hashing ----------------------------------------------------------------------------------

def _request(tokens, salt=None) -> Request:
    return Request("r", tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def test_chained_hash_depends_on_parent_tokens_and_extra_keys():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(base, bytes) and len(base) == 32
    assert base == hash_block_tokens(None, [1, 2, 3, 4])  # deterministic
    assert base == hash_block_tokens(DEFAULT_SEED, [1, 2, 3, 4])  # None means the seed
    assert base != hash_block_tokens(None, [1, 2, 3, 5])
    assert base != hash_block_tokens(h(0), [1, 2, 3, 4])  # different parent
    assert base != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))
    assert base != hash_block_tokens(None, [1, 2, 3, 4], seed=h(9))  # another model
    # extra keys are encoded unambiguously
    assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))
    assert hash_block_tokens(None, [1], ("1",)) != hash_block_tokens(None, [1], (1,))
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (1.5,))


def test_hash_is_stable_across_processes():
    # a fixed value: blocks stored on disk by an offload tier must be found after a restart
    expected = hashlib.blake2b(digest_size=32)
    expected.update(DEFAULT_SEED)
    expected.update((2).to_bytes(4, "little"))
    expected.update((5).to_bytes(8, "little") + (300).to_bytes(8, "little"))
    expected.update((0).to_bytes(4, "little"))
    assert hash_block_tokens(None, [5, 300]) == expected.digest()


def test_salt_changes_every_block_through_the_chain():
    tokens = list(range(12))
    plain = update_block_hashes(_request(tokens), 4)
    salted = update_block_hashes(_request(tokens, salt="tenant-a"), 4)
    other = update_block_hashes(_request(tokens, salt="tenant-b"), 4)
    assert len(plain) == len(salted) == 3
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert all(a != b for a, b in zip(salted, other, strict=True))
    assert update_block_hashes(_request(tokens, salt="tenant-a"), 4) == salted


def test_block_hashes_grow_incrementally_with_the_tokens():
    req = _request(list(range(6)))
    hashes = update_block_hashes(req, 4)
    assert len(hashes) == 1 and hashes is req.block_hashes
    first = hashes[0]
    req.append_output_token_ids([6])
    assert len(update_block_hashes(req, 4)) == 1
    req.append_output_token_ids([7, 8, 9, 10])
    hashes = update_block_hashes(req, 4)
    assert len(hashes) == 2 and hashes[0] is first  # earlier hashes are not recomputed
    assert hashes == update_block_hashes(_request(list(range(11))), 4)
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
