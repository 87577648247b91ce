"""bench/eagle_train_prompts.py: prompt sets for ``lmkit spec train-eagle`` that never
contain a prompt of lmkit bench's chat set, distinct, seeded; ``--tasks`` puts the
everyday chat tasks first, then the topic prompts in their usual order."""

from __future__ import annotations

import sys
from pathlib import Path

from lmkit.benchmarking.prompts import CHAT_PROMPTS

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import eagle_train_prompts as gen  # noqa: E402


def test_sets_are_disjoint_from_the_benchmark_distinct_and_seeded():
    for tasks in (False, True):
        rows = gen.prompts(1500, seed=0, tasks=tasks)
        assert len(rows) == len(set(rows)) == 1500
        assert not set(rows) & set(CHAT_PROMPTS)
        assert rows == gen.prompts(1500, seed=0, tasks=tasks)
        assert rows != gen.prompts(1500, seed=1, tasks=tasks)


def test_tasks_come_first_and_cover_every_family():
    tasks = gen.task_prompts()
    assert len(tasks) == len(set(tasks)) == sum(len(xs) for _, xs in gen.TASKS)
    n = len(tasks) * len(gen.STYLES)
    rows = gen.prompts(n + 50, seed=0, tasks=True)
    assert set(rows[:n]) == {p + s for p in tasks for s in gen.STYLES}
    assert not set(rows[n:]) & set(rows[:n])
    # then the topic prompts in their own order (the set without --tasks)
    first = set(rows[:n])
    assert rows[n:] == [p for p in gen.prompts(n + 50, seed=0) if p not in first][:50]
