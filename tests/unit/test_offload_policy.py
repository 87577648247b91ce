"""Eviction policies of the offload tiers: LRU order, ARC's scan resistance, and the
invariants of both under random operation sequences."""

from __future__ import annotations

import random

import pytest
from lmkit_plugins.offload.policy import ARCPolicy, LRUPolicy, make_policy


def test_lru_evicts_least_recently_used():
    p = LRUPolicy(3)
    for k in "abc":
        assert p.insert(k) == []
    p.touch("a")
    assert p.insert("d") == ["b"]
    assert p.insert("e") == ["c"]
    assert {k for k in "abcde" if k in p} == {"a", "d", "e"}


def test_arc_keeps_reused_keys_through_a_scan():
    """Keys hit twice survive a long run of keys seen once; under LRU they do not."""
    for policy, survives in ((ARCPolicy(8), True), (LRUPolicy(8), False)):
        hot = [f"hot{i}" for i in range(4)]
        for k in hot:
            policy.insert(k)
        for k in hot:
            policy.touch(k)
        for i in range(100):  # a scan: one-time keys
            policy.insert(f"scan{i}")
        assert all(k in policy for k in hot) is survives, type(policy).__name__


def test_arc_adapts_towards_recency_on_ghost_hits():
    p = ARCPolicy(4)
    for k in "abcd":
        p.insert(k)
    p.touch("d")  # d moves to t2 (frequency)
    p.insert("e")  # t1 is over its target: evicts a, remembered in ghost list b1
    assert "a" not in p and "a" in p.b1
    before = p.p
    p.insert("a")  # a ghost hit in b1: recency deserved more room
    assert p.p > before and "a" in p.t2


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_invariants_under_random_operations(name):
    rng = random.Random(0)
    p = make_policy(name, 16)
    held: set[int] = set()
    for _ in range(5000):
        op = rng.random()
        key = rng.randrange(64)
        if key in held and op < 0.4:
            p.touch(key)
        elif key in held and op < 0.45:
            p.remove(key)
            held.discard(key)
        elif key not in held:
            evicted = p.insert(key)
            assert key not in evicted
            assert set(evicted) <= held, "evicted a key that was not held"
            held -= set(evicted)
            held.add(key)
        assert len(p) == len(held) <= 16
        assert all(k in p for k in held)
    if name == "arc":
        assert len(p.t1) + len(p.b1) <= 16 and len(p.t1) + len(p.t2) + len(p.b1) + len(p.b2) <= 32


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'; known: lru, arc"):
        make_policy("fifo", 4)
