"""The data-parallel router: least outstanding requests (then tokens), rotating ties,
prefix affinity bounded by load, dead engines skipped."""

from __future__ import annotations

import pytest
from lmkit.frontend.router import AFFINITY_BLOCKS, EngineRouter

BLOCK = 4
ALIVE2 = [True, True]


def _prompt(seed: int, blocks: int = 2) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BLOCK)]


def _send(router: EngineRouter, prompt: list[int], alive=None) -> int:
    engine = router.choose(prompt, alive or [True] * router.num_engines)
    router.add(engine, len(prompt))
    return engine


def test_idle_engines_take_turns_and_the_least_loaded_wins():
    router = EngineRouter(3, BLOCK)
    assert [_send(router, _prompt(i)) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert router.num_requests == [2, 2, 2] and router.num_routed == [2, 2, 2]
    router.release(1, len(_prompt(0)))
    router.release(1, len(_prompt(0)))
    assert _send(router, _prompt(10)) == 1  # the only engine with fewer in flight


def test_equal_request_counts_fall_back_to_outstanding_tokens():
    router = EngineRouter(2, BLOCK)
    router.add(0, 1000)
    router.add(1, 10)
    assert router.choose(_prompt(1), ALIVE2) == 1
    router = EngineRouter(2, BLOCK)
    router.add(0, 10)
    router.add(1, 1000)
    assert router.choose(_prompt(1), ALIVE2) == 0


def test_release_never_goes_below_zero():
    router = EngineRouter(2, BLOCK)
    router.add(0, 8)
    router.release(0, 8)
    router.release(0, 8)
    assert router.num_requests == [0, 0] and router.num_tokens == [0, 0]


def test_a_shared_prefix_goes_back_to_the_engine_that_cached_it():
    router = EngineRouter(2, BLOCK)
    system = _prompt(7, blocks=2)
    first = _send(router, system + [1, 2, 3, 4, 5])
    # the other engine is now less loaded, but the prefix is cached on `first`
    assert _send(router, system + [9, 9, 9, 9]) == first
    assert router.num_affinity_hits == 1
    other = _send(router, _prompt(8))  # a new prefix: the least-loaded engine
    assert other != first


def test_affinity_yields_when_its_engine_is_clearly_busier():
    router = EngineRouter(2, BLOCK, affinity_slack=2)
    system = _prompt(3)
    home = _send(router, system)
    for _ in range(2):  # home: 3 in flight, the other none: more than 0 + 2 above it
        router.add(home, 8)
    assert _send(router, system) != home
    assert router.num_affinity_hits == 0
    # the prefix now belongs to the engine that took it
    assert _send(router, system) == 1 - home


def test_short_prompts_have_no_affinity_and_long_ones_hash_a_bounded_prefix():
    router = EngineRouter(2, BLOCK)
    assert router.prefix_hashes([1, 2, 3]) == []  # less than a block
    hashes = router.prefix_hashes(list(range(BLOCK * (AFFINITY_BLOCKS + 5))))
    assert len(hashes) == AFFINITY_BLOCKS and len(set(hashes)) == AFFINITY_BLOCKS
    # a chain: the same block after a different prefix hashes differently
    a = router.prefix_hashes([1] * BLOCK + [2] * BLOCK)
    b = router.prefix_hashes([3] * BLOCK + [2] * BLOCK)
    assert a[1] != b[1]


def test_the_affinity_table_is_bounded():
    router = EngineRouter(2, BLOCK, max_affinity_entries=5)
    for i in range(10):
        _send(router, _prompt(i, blocks=1))
    assert router.num_affinity_entries == 5


def test_dead_engines_are_skipped_and_forgotten():
    router = EngineRouter(2, BLOCK)
    system = _prompt(5)
    assert _send(router, system) == 0
    assert _send(router, system, alive=[False, True]) == 1
    router.forget_engine(1)
    assert router.num_affinity_entries == 0
    assert [_send(router, _prompt(i), alive=[True, False]) for i in range(3)] == [0, 0, 0]
    with pytest.raises(ValueError, match="no engine is alive"):
        router.choose(system, [False, False])
    with pytest.raises(ValueError, match="at least 1"):
        EngineRouter(0, BLOCK)

