"""Server lifecycle on a tiny random-weight Llama (fast to load): a killed engine process
(restarted, or the server exits), graceful SIGTERM through ``lmkit serve``, and a model
that cannot load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from lmkit.config.schema import LMKitConfig
from serve_live import CliServer, LiveServer, engine_pid_gone

pytestmark = pytest.mark.slow  # starts and kills servers, about 10 s per test


def long_body(stream=False, max_tokens=6000):
    return {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": stream}


def read_stream(url, body):
    """(status, parsed events, saw [DONE]) of one streaming completion."""
    events, done = [], False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            return resp.status_code, [json.loads(resp.read())], False
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return 200, events, done


def _start_long_requests(server, pool):
    """Two blocking and one streaming long request, all running in the engine."""
    blocking = [pool.submit(httpx.post, f"{server.url}/v1/completions", json=long_body(),
                            timeout=120) for _ in range(2)]
    streaming = pool.submit(read_stream, server.url, long_body(stream=True))
    deadline = time.monotonic() + 30
    while server.engine_stats().get("num_running") != 3:
        assert time.monotonic() < deadline, "requests never started"
        time.sleep(0.05)
    return blocking, streaming


def _assert_failed_cleanly(blocking, streaming):
    for fut in blocking:
        resp = fut.result(timeout=10)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "engine_dead"
    status, events, done = streaming.result(timeout=10)
    assert status == 200 and done and events[-1]["error"]["code"] == "engine_dead"


@pytest.mark.slow
def test_killed_engine_fails_in_flight_requests_and_is_restarted(tiny_dir):
    config = LMKitConfig.model_validate({
        "model": {"model": str(tiny_dir)},
        "server": {"served_model_name": "tiny", "engine_restart_backoff_s": 1.0}})
    with LiveServer(config) as server, ThreadPoolExecutor(4) as pool:
        blocking, streaming = _start_long_requests(server, pool)
        old_pid = server.state.llm.engine_pid
        os.kill(old_pid, signal.SIGKILL)
        killed = time.monotonic()
        while httpx.get(f"{server.url}/health").status_code != 503:
            assert time.monotonic() - killed < 5, "/health still 200 five seconds after"
            time.sleep(0.05)
        health = httpx.get(f"{server.url}/health")
        assert health.json()["status"] == "restarting" and "exited" in health.json()["error"]
        assert int(health.headers["retry-after"]) >= 1
        _assert_failed_cleanly(blocking, streaming)
        assert time.monotonic() - killed < 5
        during = httpx.post(f"{server.url}/v1/completions", json=long_body(max_tokens=2))
        assert during.status_code == 503, during.text
        assert during.json()["error"]["code"] == "engine_restarting"
        assert int(during.headers["retry-after"]) >= 1
        assert "lmkit_engine_up 0.0" in httpx.get(f"{server.url}/metrics").text
        while httpx.get(f"{server.url}/health").status_code != 200:
            assert time.monotonic() - killed < 120, "the engine was not restarted"
            time.sleep(0.1)
        assert server.state.llm.engine_pid not in (None, old_pid)
        after = httpx.post(f"{server.url}/v1/completions", json=long_body(max_tokens=2),
                           timeout=60)
        assert after.status_code == 200, after.text
        assert after.json()["usage"]["completion_tokens"] == 2
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "lmkit_engine_restarts_total 1.0" in metrics
        assert "lmkit_engine_up 1.0" in metrics
        server.wait_idle(idle_usage=server.engine_stats()["kv_cache_usage"])  # fresh gauges
    assert engine_pid_gone(old_pid)


@pytest.mark.slow
def test_cli_exits_when_the_engine_cannot_be_restarted(tiny_dir):
    env = {"LMKIT_SERVER__ENGINE_RESTART_ATTEMPTS": "0"}
    with CliServer([str(tiny_dir), "--port", "0", "--served-model-name", "tiny",
                    "--log-level", "warning"], env=env) as cli:
        engine_pid = httpx.get(f"{cli.url}/v1/lmkit/stack").json()["engine_pid"]
        os.kill(engine_pid, signal.SIGKILL)
        assert cli.wait(30) == 1, cli.output
    assert "restart" in cli.output and "Traceback" not in cli.output


def test_cli_sigterm_drains_in_flight_requests(tiny_dir):
    with CliServer([str(tiny_dir), "--port", "0", "--served-model-name", "tiny",
                    "--log-level", "warning"]) as cli:
        out = cli.output
        assert "scheduler" in out and "fcfs" in out  # the resolved stack is printed
        engine_pid = httpx.get(f"{cli.url}/v1/lmkit/stack").json()["engine_pid"]
        with ThreadPoolExecutor(1) as pool:
            # long enough to be seen running (a warm engine decodes the tiny model fast)
            fut = pool.submit(read_stream, cli.url, long_body(stream=True, max_tokens=2000))
            deadline = time.monotonic() + 30
            while httpx.get(f"{cli.url}/v1/lmkit/stack").json()["stats"].get(
                    "num_running") != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            cli.proc.send_signal(signal.SIGTERM)
            status, events, done = fut.result(timeout=60)
        assert status == 200 and done  # drained, not cut off
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        # uvicorn re-raises the handled signal once shut down, as an unhandled one would end
        assert cli.wait(60) in (0, -signal.SIGTERM)
        assert "Traceback" not in cli.output
    assert engine_pid_gone(engine_pid), "engine process outlived the server"


def test_cli_reports_a_model_that_cannot_load(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lmkit.cli.main", "serve",
                           str(tmp_path / "missing-model"), "--port", "0"],
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2  # a model that does not exist is the user's to fix
    assert "missing-model" in out and out.count("error:") == 1 and "Uvicorn" not in out
