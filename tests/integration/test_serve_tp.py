"""``lmkit serve`` with ``--tp 2`` on the CPU (gloo): a SIGKILLed tensor-parallel worker
fails the engine fast: ``/health`` turns 503 and in-flight requests get an error."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from lmkit.config.schema import LMKitConfig
from lmkit.testing.tiny_model import make_tiny_model
from serve_live import LiveServer

pytestmark = pytest.mark.slow  # starts a server with two worker processes


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_killed_tp_worker_fails_in_flight_requests_and_health(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    config = LMKitConfig.model_validate({
        "model": {"model": str(model), "dtype": "float32"},
        "executor": {"device": "cpu"}, "attention": {"backend": "torch"},
        "parallel": {"tensor_parallel_size": 2},
        "server": {"served_model_name": "tiny"}})
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 480,
            "ignore_eos": True, "temperature": 0}
    with LiveServer(config) as server, ThreadPoolExecutor(2) as pool:
        workers = _children(server.state.llm.engine_pid)
        assert len(workers) == 2, workers  # one process per rank
        in_flight = [pool.submit(httpx.post, f"{server.url}/v1/completions", json=body,
                                 timeout=60) for _ in range(2)]
        deadline = time.monotonic() + 30
        while server.engine_stats().get("num_running") != 2:
            assert time.monotonic() < deadline, "requests never started"
            time.sleep(0.02)
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        while httpx.get(f"{server.url}/health").status_code != 503:
            assert time.monotonic() - killed < 5, "/health still 200 five seconds after"
            time.sleep(0.05)
        for fut in in_flight:
            resp = fut.result(timeout=10)
            assert resp.status_code in (500, 503), resp.text
        assert time.monotonic() - killed < 5
        health = httpx.get(f"{server.url}/health").json()
        assert "rank 1" in health["error"] and "killed by signal 9" in health["error"], health
