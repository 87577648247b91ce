"""The CUDA KV-cache budget's arithmetic (``memory.kv_budget_bytes``), from the
numbers a profile measures: the engine's share, other engines' memory, and room kept
free for the CUDA graphs captured after the KV cache."""

from __future__ import annotations

from lmkit.worker.memory import HEADROOM_BYTES, kv_budget_bytes

GIB = 2**30


def test_the_share_less_this_engines_peak_and_memory_outside_torch():
    # 100 GiB device; the engine's peak 10 GiB; 1 GiB held outside torch (context)
    got = kv_budget_bytes(0.9, total=100 * GIB, free=89 * GIB, reserved=10 * GIB,
                          peak=10 * GIB)
    assert got == 90 * GIB - 10 * GIB - 1 * GIB


def test_other_engines_memory_does_not_count_against_the_share_but_free_memory_binds():
    # another engine of this process holds 60 GiB (baseline): the share would be 79 GiB,
    # but only 29 GiB are free
    got = kv_budget_bytes(0.9, total=100 * GIB, free=29 * GIB, reserved=70 * GIB,
                          peak=70 * GIB, baseline=60 * GIB)
    assert got == 29 * GIB - HEADROOM_BYTES


def test_graphs_keep_their_room_when_free_memory_binds():
    """With free memory binding, the KV cache used to take all but 256 MiB, and the
    piecewise graphs captured after it ran out of memory (an H200 test run)."""
    args = dict(total=100 * GIB, free=29 * GIB, reserved=70 * GIB, peak=70 * GIB,
                baseline=60 * GIB)
    without = kv_budget_bytes(0.9, **args)
    with_graphs = kv_budget_bytes(0.9, graph_reserve=2 * GIB, **args)
    assert without - with_graphs == 2 * GIB
    # when the share binds, the reserve changes nothing (the share leaves room)
    share = dict(total=100 * GIB, free=89 * GIB, reserved=10 * GIB, peak=10 * GIB)
    assert kv_budget_bytes(0.9, graph_reserve=2 * GIB, **share) == kv_budget_bytes(0.9, **share)


def test_never_negative():
    assert kv_budget_bytes(0.1, total=100 * GIB, free=1 * GIB, reserved=80 * GIB,
                           peak=80 * GIB) == 0
