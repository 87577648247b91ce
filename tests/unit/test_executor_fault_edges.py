"""A worker or the engine-core process dies, raises or hangs: the engine reports itself
failed with an lmkit error instead of blocking, and no process outlives its parent.
Faults: signals (``SIGSTOP`` stands for a hung rank), a test plugin the ``mp`` workers
import (:data:`FAULT_SOURCE`), or a patched runner. Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from lmkit.api import LMKitError, SamplingParams
from lmkit.testing.tiny_model import make_tiny_model

FAULT_PLUGIN = "lmkit_test_fault_injection"
FAULT_SOURCE = '''
"""Test plugin: LMKIT_TEST_FAULT="KIND:RANK:STEP" makes the mp worker of rank RANK
raise (KIND "raise") or hang (KIND "hang") at its STEP-th step; inert elsewhere."""
import os, sys, time

LMKIT_PLUGIN_API = ">=1.0,<2"
main = getattr(sys.modules.get("__main__"), "__spec__", None)
if os.environ.get("LMKIT_TEST_FAULT") and getattr(main, "name", "") == (
        "lmkit_plugins.executors.mp_worker"):
    from lmkit.api import ModelRunner

    kind, rank, step = os.environ["LMKIT_TEST_FAULT"].split(":")
    original, seen = ModelRunner.execute_model, [0]

    def execute_model(self, scheduler_output):
        if self.tp_rank == int(rank):
            seen[0] += 1
            if seen[0] == int(step):
                if kind == "hang":
                    time.sleep(3600)
                raise RuntimeError(f"injected fault in rank {rank} at step {step}")
        return original(self, scheduler_output)

    ModelRunner.execute_model = execute_model
'''

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TINY = dict(device="cpu", dtype="float32", attention="torch", max_model_len=128,
            num_blocks=64, progress=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-faults"))


@pytest.fixture
def fault_plugin(tmp_path, monkeypatch):
    """:data:`FAULT_SOURCE` on the path here and in the workers (set LMKIT_TEST_FAULT)."""
    (tmp_path / f"{FAULT_PLUGIN}.py").write_text(FAULT_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return FAULT_PLUGIN


def _gone(pid: int) -> bool:
    """The process exited (a zombie whose parent died counts: nobody may reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(_gone(p) for p in pids)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def _bounded(fn, timeout: float, unblock) -> tuple[BaseException | None, float]:
    """Run ``fn`` in a thread; its exception (``None``: it returned) and its duration.
    After ``timeout`` seconds (a regression: it hangs) ``unblock()`` runs and the test
    fails."""
    result: dict[str, BaseException | None] = {"error": None}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    began = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    elapsed = time.monotonic() - began
    if thread.is_alive():
        unblock()
        thread.join(30)
        pytest.fail(f"still blocked after {timeout:g}s")
    return result["error"], elapsed


@pytest.mark.slow
def test_hung_rank_fails_generate_within_the_step_timeout(model_dir):
    """A rank that stops answering (SIGSTOP: it neither runs nor dies) used to block
    LLM.generate forever; now the step fails after executor.options.execute_timeout_s
    with an lmkit error, every rank is killed, and later calls fail at once."""
    from lmkit.frontend.llm import LLM
    from lmkit_plugins.executors.mp import WorkerFailedError

    llm = LLM(str(model_dir), tensor_parallel_size=2,
              **{"executor.options.execute_timeout_s": 2}, **TINY)
    pids = [p.pid for p in llm.engine.executor.procs]
    try:
        os.kill(pids[1], signal.SIGSTOP)
        error, elapsed = _bounded(lambda: llm.generate(["hello"], GREEDY), 30,
                                  lambda: _kill(pids))
        assert isinstance(error, WorkerFailedError), error
        assert "within 2s (executor.options.execute_timeout_s)" in str(error)
        assert elapsed < 15 and _wait_gone(pids, 5)  # the stopped rank is killed too
        error, elapsed = _bounded(lambda: llm.generate(["again"], GREEDY), 10, lambda: None)
        assert isinstance(error, WorkerFailedError) and elapsed < 1
    finally:
        _kill(pids)
        llm.shutdown()


@pytest.mark.slow
def test_rank_raising_in_a_step_is_named_as_the_cause(model_dir, fault_plugin, monkeypatch):
    """Rank 1 raises inside a step; rank 0 then fails in its collective and exits too:
    generate raises, naming rank 1's own error first, and no worker is left running."""
    from lmkit.frontend.llm import LLM
    from lmkit_plugins.executors.mp import WorkerFailedError

    monkeypatch.setenv("LMKIT_TEST_FAULT", "raise:1:3")
    llm = LLM(str(model_dir), tensor_parallel_size=2, plugins=[fault_plugin], **TINY)
    pids = [p.pid for p in llm.engine.executor.procs]
    try:
        error, elapsed = _bounded(lambda: llm.generate(["hello"], GREEDY), 60,
                                  lambda: _kill(pids))
        assert isinstance(error, WorkerFailedError), error
        assert str(error).startswith(
            "worker rank 1 failed: RuntimeError: injected fault in rank 1 at step 3"), error
        assert _wait_gone(pids, 5)
    finally:
        _kill(pids)
        llm.shutdown()


@pytest.mark.parametrize("rank0_status, cause", [
    (1, "worker rank 1 failed: RuntimeError: boom"),  # rank 0 failed after rank 1
    (-9, "worker rank 0 (pid 1) was killed by signal 9 (then worker rank 1 failed")])
def test_failure_names_the_rank_that_failed_first(tmp_path, rank0_status, cause):
    """Rank 1 reports an error and rank 0 has exited. Status 1: rank 0 failed after rank 1
    (its collective lost the peer; the error used to blame rank 0); killed by a signal:
    its death made rank 1 fail, so it is named first."""
    import msgspec
    import zmq
    from lmkit_plugins.executors.mp import MultiprocExecutor, WorkerFailedError
    from lmkit_plugins.executors.mp_messages import Failed, executor_decoder

    def exited(pid, status):  # a worker process that is gone
        return SimpleNamespace(pid=pid, returncode=status, poll=lambda: status,
                               wait=lambda timeout=None: status)

    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor.world_size, executor.procs = 2, [exited(1, rank0_status), exited(2, 1)]
    ctx = zmq.Context()
    executor._replies = ctx.socket(zmq.PULL)
    executor._replies.bind(f"ipc://{tmp_path}/replies")
    executor._decoder = executor_decoder()
    rank1 = ctx.socket(zmq.PUSH)
    rank1.connect(f"ipc://{tmp_path}/replies")
    rank1.send(msgspec.msgpack.encode(Failed(1, "RuntimeError: boom", "RuntimeError")))
    try:
        with pytest.raises(WorkerFailedError) as info:
            executor._recv(1)  # (the exited stand-ins end it, whatever happens)
        assert str(info.value).startswith(cause), info.value
    finally:
        rank1.close(0)
        executor._replies.close(0)
        ctx.term()


@pytest.mark.slow
def test_hung_ray_actor_fails_generate_within_the_step_timeout(model_dir, monkeypatch):
    """The ray executor waited forever on a hung actor too; now as mp above."""
    ray = pytest.importorskip("ray")
    from lmkit.frontend.llm import LLM
    from lmkit_plugins.executors.failure import WorkerFailedError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local Ray, owned by the executor
    llm = LLM(str(model_dir), tensor_parallel_size=2, **TINY, **{
        "parallel.distributed_backend": "ray", "executor.options.execute_timeout_s": 2})
    pids = [ray.get(a.pid.remote()) for a in llm.engine.executor.actors]
    try:
        os.kill(pids[1], signal.SIGSTOP)
        error, elapsed = _bounded(lambda: llm.generate(["hello"], GREEDY), 30,
                                  lambda: _kill(pids))
        assert isinstance(error, WorkerFailedError), error
        assert "within 2s" in str(error) and elapsed < 15
    finally:
        _kill(pids)
        llm.shutdown()
    assert not ray.is_initialized()


ENGINE_SCRIPT = """
import json, sys
from lmkit.frontend.llm import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, plugins=sys.argv[2:], **{tiny!r})
ex = llm.engine.executor
print(json.dumps({{"pids": [p.pid for p in ex.procs], "tmpdir": str(ex._tmpdir)}}), flush=True)
if sys.argv[2:]:  # the fault plugin: a rank hangs in the first step, this waits on it
    llm.generate(["hello"])
# else: exit without shutdown()
"""


def _start_engine(tmp_path: Path, model_dir: Path, *plugins: str
                  ) -> tuple[subprocess.Popen[str], dict]:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT.format(tiny=TINY))
    proc = subprocess.Popen([sys.executable, str(script), str(model_dir), *plugins],  # its
                            stdout=subprocess.PIPE, text=True,  # temp dirs in tmp_path
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    if not (line := proc.stdout.readline() if proc.stdout else ""):  # ends at its exit
        proc.kill()
        pytest.fail(f"the engine script failed (status {proc.wait(30)})")
    return proc, json.loads(line)


@pytest.mark.slow
def test_ranks_stuck_in_a_step_exit_when_the_engine_process_is_killed(
        tmp_path, model_dir, fault_plugin, monkeypatch):
    """Rank 1 hangs inside a step and rank 0 waits for it in a collective; the engine
    process is SIGKILLed. Both ranks used to stay (rank 1 forever, rank 0 for the 30
    minute collective timeout); their watchdog ends them within seconds."""
    monkeypatch.setenv("LMKIT_TEST_FAULT", "hang:1:1")
    engine, info = _start_engine(tmp_path, model_dir, fault_plugin)
    try:
        time.sleep(1.0)  # both ranks are in the step by now
        assert not any(_gone(p) for p in info["pids"])
        engine.kill()
        engine.wait(30)
        assert _wait_gone(info["pids"], 10), "a stuck rank outlived its engine process"
    finally:
        engine.kill()
        _kill(info["pids"])


@pytest.mark.slow
def test_exit_without_shutdown_kills_the_ranks_and_removes_the_channel(tmp_path, model_dir):
    """A program that never closes its LLM: at exit the ranks are killed at once (they
    used to linger until they noticed) and the channel's directory is removed (it used
    to stay in /tmp)."""
    engine, info = _start_engine(tmp_path, model_dir)
    try:
        assert engine.wait(60) == 0
        assert all(_gone(p) for p in info["pids"])
        assert not Path(info["tmpdir"]).exists()
    finally:
        engine.kill()
        _kill(info["pids"])


def test_failed_start_removes_the_channel(tmp_path, monkeypatch):
    """start() raising (here: no model to read facts from) used to leave the executor's
    temp directory behind; nothing is left."""
    import tempfile

    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.manager import PluginHost
    from lmkit.plugin_host.resolve import resolve_stack
    from lmkit_plugins.executors.mp import MultiprocExecutor

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where mkdtemp makes its dirs
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    config = LMKitConfig.model_validate({
        "model": {"model": str(tmp_path / "missing")}, "executor": {"device": "cpu"},
        "attention": {"backend": "torch"}, "parallel": {"tensor_parallel_size": 2}})
    executor = MultiprocExecutor(config, resolve_stack(config, host), host=host)
    try:
        with pytest.raises(Exception):  # noqa: B017 - whatever reading the model raises
            executor.start()
        left = list(temp.iterdir())
    finally:
        executor.shutdown()  # still safe (and, should start() leak, frees its sockets)
    assert not left and executor.procs == []



def test_uniproc_step_error_is_an_lmkit_error_and_final(model_dir, monkeypatch):
    """A runner that raises in a step: LLM.generate used to raise the bare RuntimeError
    and the next call ran on the runner's undefined state; it raises WorkerFailedError
    (an LMKitError, the cause chained) and so does every later step."""
    from lmkit.api import ModelRunner
    from lmkit.frontend.llm import LLM
    from lmkit_plugins.executors.failure import WorkerFailedError

    original, calls = ModelRunner.execute_model, [0]

    def execute_model(self, scheduler_output):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("device fault")
        return original(self, scheduler_output)

    monkeypatch.setattr(ModelRunner, "execute_model", execute_model)
    with LLM(str(model_dir), **TINY) as llm:
        with pytest.raises(WorkerFailedError, match="RuntimeError: device fault") as info:
            llm.generate(["hello"], GREEDY)
        assert isinstance(info.value, LMKitError)
        assert isinstance(info.value.__cause__, RuntimeError)
        with pytest.raises(WorkerFailedError):
            llm.generate(["again"], GREEDY)
        assert calls[0] == 2  # the failed runner was not stepped again



CORE_SCRIPT = """
import sys, time
import lmkit.engine.core_proc as core_proc
core_proc.ORPHAN_EXIT_S = 1.0

class StuckEngine:  # has work, and its step never returns
    def has_unfinished_requests(self): return True
    def step(self): time.sleep(3600)

core_proc.EngineCoreProc(StuckEngine(), sys.argv[1], sys.argv[2],
                         parent_pid=int(sys.argv[3])).run()
"""

FRONTEND_SCRIPT = """
import os, subprocess, sys, time
import zmq

ctx = zmq.Context()
inp, out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
inp.bind(f"ipc://{sys.argv[2]}/in"), out.bind(f"ipc://{sys.argv[2]}/out")
core = subprocess.Popen([sys.executable, sys.argv[1], f"ipc://{sys.argv[2]}/in",
                         f"ipc://{sys.argv[2]}/out", str(os.getpid())])
print(core.pid, flush=True)
time.sleep(3600)
"""


def test_engine_core_stuck_in_a_step_exits_when_the_frontend_dies(tmp_path):
    """The API process is SIGKILLed while the engine core's step never returns: the core
    checked its parent only between steps and stayed forever; its watchdog ends it."""
    (tmp_path / "core.py").write_text(textwrap.dedent(CORE_SCRIPT))
    (tmp_path / "frontend.py").write_text(textwrap.dedent(FRONTEND_SCRIPT))
    frontend = subprocess.Popen(
        [sys.executable, str(tmp_path / "frontend.py"), str(tmp_path / "core.py"),
         str(tmp_path)], stdout=subprocess.PIPE, text=True)
    core_pid = None
    try:
        core_pid = int(frontend.stdout.readline() if frontend.stdout else "")
        time.sleep(1.5)  # the core imports, connects and enters its stuck step
        assert not _gone(core_pid)
        frontend.kill()
        frontend.wait(10)
        assert _wait_gone([core_pid], 10), "the stuck engine core outlived its frontend"
    finally:
        frontend.kill()
        if core_pid is not None:
            _kill([core_pid])


def test_engine_core_closes_at_once_when_its_frontend_is_gone(tmp_path):
    """Outputs queued for a frontend that is gone no longer hold the exit for the
    socket's 2 s linger."""
    import zmq
    from lmkit.engine.core_proc import EngineCoreProc
    from lmkit.engine.messages import EngineStats

    ctx = zmq.Context()
    # nobody binds these: what the core sends stays queued, as for a dead frontend
    proc = EngineCoreProc(SimpleNamespace(), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", ctx=ctx)
    proc.send(EngineStats(stats={"x": 1.0}))
    proc.parent_gone = True
    began = time.monotonic()
    proc.close()
    ctx.term()
    assert time.monotonic() - began < 1.0
