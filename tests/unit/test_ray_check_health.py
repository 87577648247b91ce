"""The ``ray`` executor's idle health check (``Executor.check_health``): an actor that
dies while the engine is idle is reported (``WorkerFailedError`` naming its rank) before
the next request arrives, without the check ever waiting on an actor.

The first tests drive the executor against a stand-in ``ray`` module (no Ray needed);
the last one kills a real actor of a local Ray (slow; skipped where Ray is missing)."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
from lmkit_plugins.executors.failure import WorkerFailedError
from lmkit_plugins.executors.ray_executor import RayExecutor


class FakeRayActorError(Exception):
    """Stands in for ``ray.exceptions.RayActorError``."""


class FakeRef:
    """An actor call's result: ``ready`` once it came back, an ``error`` if it failed."""

    def __init__(self, rank: int, ready: bool, error: Exception | None) -> None:
        self.rank, self.ready, self.error = rank, ready, error


class FakeRay(types.ModuleType):
    """The part of ``ray`` the health check and ``_kill_all`` use. Like Ray: a call to
    an actor that is dead fails, a call sent before it died came back fine, a call to
    a ``slow`` actor stays in flight."""

    def __init__(self) -> None:
        super().__init__("ray")
        self.dead: set[int] = set()
        self.slow: set[int] = set()
        self.sent: list[int] = []  # ranks, one per liveness call
        self.wait_timeouts: list[float | None] = []
        self.killed: list[int] = []

    def actor(self, rank: int) -> SimpleNamespace:
        return SimpleNamespace(rank=rank, pid=SimpleNamespace(remote=lambda: self._send(rank)))

    def _send(self, rank: int) -> FakeRef:
        self.sent.append(rank)
        error = FakeRayActorError(f"The actor died unexpectedly (rank {rank})\ndetails")
        return FakeRef(rank, rank not in self.slow, error if rank in self.dead else None)

    def wait(self, refs: list[FakeRef], *, num_returns: int = 1,
             timeout: float | None = None) -> tuple[list[FakeRef], list[FakeRef]]:
        self.wait_timeouts.append(timeout)
        return [r for r in refs if r.ready], [r for r in refs if not r.ready]

    def get(self, ref: FakeRef, timeout: float | None = None) -> int:
        assert ref.ready, "get() of a call still in flight would block"
        if ref.error is not None:
            raise ref.error
        return 1000 + ref.rank

    def kill(self, actor: SimpleNamespace, no_restart: bool = True) -> None:
        self.killed.append(actor.rank)


@pytest.fixture
def fake_ray(monkeypatch):
    ray = FakeRay()
    exceptions = types.ModuleType("ray.exceptions")
    exceptions.RayError = Exception  # type: ignore[attr-defined]
    exceptions.RayActorError = FakeRayActorError  # type: ignore[attr-defined]
    util = types.ModuleType("ray.util")
    pg = types.ModuleType("ray.util.placement_group")
    pg.remove_placement_group = lambda group: None  # type: ignore[attr-defined]
    for name, module in (("ray", ray), ("ray.exceptions", exceptions), ("ray.util", util),
                         ("ray.util.placement_group", pg)):
        monkeypatch.setitem(sys.modules, name, module)
    return ray


def _executor(ray: FakeRay, world_size: int = 2) -> RayExecutor:
    config = SimpleNamespace(parallel=SimpleNamespace(tensor_parallel_size=world_size))
    executor = RayExecutor(config, None)  # type: ignore[arg-type]
    executor.actors = [ray.actor(rank) for rank in range(world_size)]  # as start() leaves
    return executor


def test_an_actor_that_died_while_idle_fails_the_check(fake_ray):
    executor = _executor(fake_ray)
    for _ in range(3):
        executor.check_health()  # every actor answers: nothing to report
    fake_ray.dead.add(1)
    with pytest.raises(WorkerFailedError) as failed:
        for _ in range(2):  # the call sent before it died came back fine; the next fails
            executor.check_health()
    message = str(failed.value)
    assert message.startswith("worker rank 1 (Ray actor) died while the engine was idle: "
                              "FakeRayActorError: The actor died unexpectedly (rank 1);")
    assert "the 2-rank model cannot go on (the other ranks were stopped)" in message
    assert sorted(fake_ray.killed) == [0, 1] and executor.actors == []
    with pytest.raises(WorkerFailedError, match=r"worker rank 1 \(Ray actor\) died"):
        executor.check_health()  # and it stays failed
    assert set(fake_ray.wait_timeouts) == {0}  # never waited on an actor


def test_a_slow_actor_is_neither_reported_nor_asked_again(fake_ray):
    executor = _executor(fake_ray, world_size=3)
    fake_ray.slow.add(2)
    for _ in range(5):
        executor.check_health()
    assert fake_ray.sent.count(2) == 1  # one call in flight, not one per check
    assert fake_ray.sent.count(0) == 5 and fake_ray.killed == []
    fake_ray.dead.add(0)
    with pytest.raises(WorkerFailedError, match=r"^worker rank 0 \(Ray actor\) died"):
        for _ in range(2):
            executor.check_health()


def test_nothing_to_check_before_start(fake_ray):
    executor = RayExecutor(SimpleNamespace(  # type: ignore[arg-type]
        parallel=SimpleNamespace(tensor_parallel_size=2)), None)  # type: ignore[arg-type]
    executor.check_health()
    assert fake_ray.sent == [] and fake_ray.wait_timeouts == []


@pytest.mark.slow
def test_a_real_actor_killed_while_idle_fails_the_check(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    import os
    import signal
    import time

    from lmkit.api.contract import build
    from lmkit.config.schema import LMKitConfig
    from lmkit.loading.model_facts import load_model_facts
    from lmkit.plugin_host.manager import PluginHost
    from lmkit.plugin_host.resolve import resolve_stack
    from lmkit.testing.tiny_model import make_tiny_model

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local Ray, owned by the executor
    model_dir = make_tiny_model(tmp_path / "tiny")
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    config = LMKitConfig.model_validate({
        "model": {"model": str(model_dir), "dtype": "float32", "max_model_len": 64},
        "cache": {"block_size": 4, "num_blocks": 16}, "attention": {"backend": "torch"},
        "executor": {"device": "cpu"},
        "parallel": {"tensor_parallel_size": 2, "distributed_backend": "ray"}})
    stack = resolve_stack(config, host)
    executor = build("executor", stack.get("executor").spec.load(), config, stack,
                     options=None, host=host, facts=load_model_facts(model_dir, host, 64))
    try:
        executor.start()
        executor.initialize_kv_cache(16)
        for _ in range(3):
            executor.check_health()  # all alive
            time.sleep(0.2)
        os.kill(ray.get(executor.actors[1].pid.remote()), signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises(WorkerFailedError,  # polled as the engine does
                           match=r"worker rank 1 \(Ray actor\) died while the engine was idle"):
            while time.monotonic() - began < 20.0:
                executor.check_health()
                time.sleep(0.25)
        assert time.monotonic() - began < 5.0  # about two checks, not the timeout
        assert executor.actors == []  # the other actor was killed too
    finally:
        executor.shutdown()
        executor.shutdown()
    assert not ray.is_initialized()
