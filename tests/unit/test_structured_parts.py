"""Constraint parsing, the bounded grammar cache, and the compile pool's time limits."""

from __future__ import annotations

import threading
import time

import pytest
from lmkit.errors import InvalidRequestError
from lmkit.structured.cache import GrammarCache
from lmkit.structured.compile_pool import CompilePool
from lmkit.structured.constraint import parse_constraint, validate_structured_outputs


def test_constraints_parse_with_order_preserving_keys():
    a = parse_constraint({"json": {"type": "object", "properties": {"x": {}, "y": {}}}})
    b = parse_constraint({"json": '{"type": "object", "properties": {"x": {}, "y": {}}}'})
    c = parse_constraint({"json": {"type": "object", "properties": {"y": {}, "x": {}}}})
    assert a.kind == "json" and a.feature == "json_schema"
    assert a.key == b.key != c.key  # text and dict share an entry; property order matters
    assert parse_constraint({"json_object": True}).feature == "json_object"
    assert parse_constraint({"choice": ("a", "b"), "regex": None}).spec == ["a", "b"]
    assert parse_constraint({"grammar": 'root ::= "x"'}).describe() == 'grammar "root ::= \\"x\\""'


@pytest.mark.parametrize(("value", "message"), [
    ({}, "exactly one constraint"),
    ({"json": {}, "regex": "a"}, "exactly one constraint"),
    ({"jsonschema": {}}, "unknown structured_outputs kind 'jsonschema'"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1]}, "must be a JSON schema"),
    ({"regex": ""}, "non-empty string"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 1]}, "non-empty list"),
    ({"json_object": False}, "json_object takes true"),
    ("json", "must be an object"),
])
def test_malformed_constraints_are_invalid_requests(value, message):
    with pytest.raises(InvalidRequestError, match=message) as exc:
        validate_structured_outputs(value)
    assert exc.value.param == "structured_outputs"


def test_cache_evicts_least_recently_used_by_count_and_bytes():
    cache = GrammarCache(max_entries=3, max_bytes=100)
    for k in "abc":
        cache.put(k, k.upper(), 10)
    assert cache.get("a") == "A"  # a is now the most recent
    cache.put("d", "D", 10)
    assert "b" not in cache and list("acd") == sorted(k for k in "abcd" if k in cache)
    cache.put("e", "E", 85)  # 115 bytes: evicts c, then a (least recently used first)
    assert sorted(k for k in "acde" if k in cache) == ["d", "e"] and cache.num_bytes == 95
    cache.put("huge", "H", 101)  # larger than the whole cache: never kept
    assert "huge" not in cache
    stats = cache.stats()
    assert stats["grammar_cache_hits"] == 1 and stats["grammar_cache_evictions"] >= 3
    assert GrammarCache(0).put("x", 1) is None and len(GrammarCache(0)) == 0


def test_cache_stays_bounded_under_a_flood_of_unique_keys():
    cache = GrammarCache(max_entries=16, max_bytes=1000)
    for i in range(5000):
        cache.put(f"schema-{i}", object(), 50)
    assert len(cache) <= 16 and cache.num_bytes <= 1000


def test_pool_runs_jobs_and_reports_errors():
    pool = CompilePool(2)
    ok = pool.submit(lambda x: x * 2, 21)
    bad = pool.submit(lambda: 1 / 0)
    assert ok.future.result(5) == 42
    with pytest.raises(ZeroDivisionError):
        bad.future.result(5)
    pool.shutdown()


def test_abandoned_job_keeps_running_while_a_replacement_thread_serves_the_queue():
    pool = CompilePool(1)
    release = threading.Event()
    slow = pool.submit(release.wait, 10)
    while slow.started_at is None:
        time.sleep(0.001)
    queued = pool.submit(lambda: "next")
    pool.abandon(slow)  # the only thread is stuck: a replacement takes the queue
    assert queued.future.result(5) == "next"
    assert pool.num_abandoned == 1 and pool.num_abandoned_total == 1
    release.set()
    assert slow.future.result(5) is True  # finished in the background
    deadline = time.monotonic() + 5
    while pool.num_abandoned and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pool.num_abandoned == 0
    pool.shutdown()


def test_abandoning_a_queued_job_cancels_it_and_replacements_are_capped():
    pool = CompilePool(1, max_abandoned=1)
    gates = [threading.Event() for _ in range(3)]
    first = pool.submit(gates[0].wait, 10)
    queued = pool.submit(lambda: "never")
    pool.abandon(queued)
    assert queued.future.cancelled()
    while first.started_at is None:
        time.sleep(0.001)
    pool.abandon(first)
    second = pool.submit(gates[1].wait, 10)
    while second.started_at is None:
        time.sleep(0.001)
    pool.abandon(second)  # cap reached: no third thread
    assert pool.num_abandoned == 1 and pool.num_abandoned_total == 1
    for g in gates:
        g.set()
    pool.shutdown()
