"""The ``ray`` executor on the CPU: a local Ray started by the test (and stopped by the
executor), the same tokens as ``uniproc`` at TP=2, and a killed actor fails the call
fast. Skipped where Ray is not installed."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("ray")

from lmkit.api import Request, SamplingParams  # noqa: E402
from lmkit.plugin_host.manager import PluginHost  # noqa: E402
from lmkit.testing.executor import check_executor  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # starts a local Ray and two actors importing torch

RAY = {"tensor_parallel_size": 2, "distributed_backend": "ray"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-ray"))


@pytest.fixture(scope="module")
def host():
    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local Ray, owned by the executor


def test_ray_tp2_tokens_equal_uniproc(host, model_dir):
    results = check_executor(host.registry.get("executor", "ray"), model_dir=model_dir,
                             parallel=RAY)
    assert set(results.values()) == {"passed"}
    import ray

    assert not ray.is_initialized()  # the local Ray it started is stopped


def test_ray_tp2_uneven_kv_heads_equal_uniproc(host, tmp_path):
    """3 KV heads over 2 actors (2 + 1 groups): the same tokens as uniproc."""
    model = make_tiny_model(tmp_path / "uneven", hidden_size=96, num_heads=6, num_kv_heads=3)
    results = check_executor(host.registry.get("executor", "ray"), model_dir=model,
                             parallel=RAY)
    assert set(results.values()) == {"passed"}


def test_killed_actor_fails_execute_within_5s(host, model_dir):
    import ray
    from lmkit.api.contract import build
    from lmkit.config.schema import LMKitConfig
    from lmkit.loading.model_facts import load_model_facts
    from lmkit.plugin_host.resolve import resolve_stack
    from lmkit.scheduler.paged import PagedScheduler
    from lmkit_plugins.executors.mp import WorkerFailedError

    config = LMKitConfig.model_validate({
        "model": {"model": str(model_dir), "dtype": "float32", "max_model_len": 64},
        "cache": {"block_size": 4, "num_blocks": 16}, "attention": {"backend": "torch"},
        "executor": {"device": "cpu"}, "parallel": RAY})
    stack = resolve_stack(config, host)
    assert stack.get("executor").name == "ray"
    # as the engine builds it (lmkit.api.contract.build: the checked constructor call)
    executor = build("executor", stack.get("executor").spec.load(), config, stack,
                     options=None, host=host, facts=load_model_facts(model_dir, host, 64))
    try:
        executor.start()
        executor.initialize_kv_cache(16)
        sched = PagedScheduler(config, num_blocks=16)
        sched.add_request(Request("r", [1, 2, 3, 4, 5], SamplingParams(
            temperature=0.0, max_tokens=20, ignore_eos=True), arrival_time=0.0))
        so = sched.schedule()
        sched.update_from_output(so, executor.execute(so))
        os.kill(ray.get(executor.actors[1].pid.remote()), signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"worker rank 1 \(Ray actor\) died"):
            executor.execute(sched.schedule())
        assert time.monotonic() - began < 5.0
    finally:
        executor.shutdown()
        executor.shutdown()
    assert not ray.is_initialized()
