"""A worker that dies while the engine is idle is reported at once, not when the next
request arrives: the engine-core process checks its executor about once a second while
idle (``Executor.check_health``), and a failed check ends it as a failed step does
(EngineFailed), so ``lmkit serve``'s /health turns 503 and the engine restarts."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest
from lmkit.testing.tiny_model import make_tiny_model

TINY = dict(device="cpu", dtype="float32", attention="torch", max_model_len=128,
            num_blocks=64, progress=False)


@pytest.mark.slow
def test_a_rank_killed_while_idle_fails_the_health_check(tmp_path):
    from lmkit.frontend.llm import LLM
    from lmkit_plugins.executors.mp import WorkerFailedError

    llm = LLM(str(make_tiny_model(tmp_path / "tiny")), tensor_parallel_size=2, **TINY)
    procs = llm.engine.executor.procs
    try:
        llm.engine.check_health()  # all running: nothing to report
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait(10)
        with pytest.raises(WorkerFailedError, match=r"worker rank 1 .* was killed by signal "
                                                    r"9 while the engine was idle"):
            llm.engine.check_health()
        assert procs[0].wait(10) is not None  # the other rank was stopped
        with pytest.raises(WorkerFailedError):  # and it stays failed
            llm.engine.check_health()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        llm.shutdown()


def test_the_idle_loop_checks_the_engine_and_fails_like_a_step(tmp_path, monkeypatch):
    import threading

    import zmq
    from lmkit.engine import core_proc
    from lmkit.engine.core_proc import EngineCoreProc

    checks: list[float] = []

    def check_health():
        checks.append(time.monotonic())
        if len(checks) == 3:
            raise RuntimeError("worker rank 1 died")

    engine = SimpleNamespace(has_unfinished_requests=lambda: False, stats=lambda: {},
                             take_rejected_requests=lambda: [], check_health=check_health)
    monkeypatch.setattr(core_proc, "HEALTH_CHECK_INTERVAL_S", 0.05)
    ctx = zmq.Context()
    proc = EngineCoreProc(engine, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", ctx=ctx)
    stopper = threading.Timer(5.0, lambda: setattr(proc, "should_stop", True))  # no hang
    stopper.start()
    try:
        with pytest.raises(RuntimeError, match="worker rank 1 died"):
            proc.run()  # idle: only the checks run, until one fails
        assert len(checks) == 3 and checks[2] - checks[0] >= 0.09  # paced, not spinning
    finally:
        stopper.cancel()
        proc.parent_gone = True  # nobody reads: close without lingering
        proc.close()
        ctx.term()
