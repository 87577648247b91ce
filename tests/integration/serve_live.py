"""A live lmkit server on loopback for integration tests: uvicorn in a thread with the
engine core in its own process (:class:`LiveServer`), or the whole ``lmkit serve``
command in a subprocess (:class:`CliServer`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import uvicorn
from lmkit.config.schema import LMKitConfig
from lmkit.serve.app import build_app


class LiveServer:
    """``with LiveServer(config) as server:`` serves until the block ends."""

    def __init__(self, config: LMKitConfig, startup_timeout: float = 300.0) -> None:
        self.config = config
        self.app = build_app(config)
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
            timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.startup_timeout = startup_timeout
        self.url = ""

    @property
    def state(self) -> Any:
        return self.app.state.lmkit

    @property
    def headers(self) -> dict[str, str]:
        key = self.config.server.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        while True:
            if self.state.startup_error:
                self.__exit__()
                raise RuntimeError(f"engine failed to start: {self.state.startup_error}")
            if httpx.get(f"{self.url}/health").status_code == 200:
                return self
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("engine not ready in time")
            time.sleep(0.2)

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(60)

    def engine_stats(self) -> dict[str, float]:
        """The engine's latest pushed stats (``GET /v1/lmkit/stack``)."""
        resp = httpx.get(f"{self.url}/v1/lmkit/stack", headers=self.headers)
        resp.raise_for_status()
        return resp.json()["stats"]

    def wait_idle(self, idle_usage: float, timeout: float = 10.0) -> dict[str, float]:
        """Poll until no request runs or waits and KV usage is back to ``idle_usage``."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine_stats()
            if (stats.get("num_running") == 0 and stats.get("num_waiting") == 0
                    and stats.get("kv_cache_usage") == idle_usage):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {stats}")
            time.sleep(0.1)


class CliServer:
    """``lmkit serve ARGS`` in a subprocess: ``with CliServer([...]) as cli:`` waits for
    the URL line (``cli.url``), collects the output (``cli.output``), and stops the
    server and its engine process at the end, killing them if they linger."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 startup_timeout: float = 240.0) -> None:
        self.args = args
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.startup_timeout = startup_timeout
        self.lines: list[str] = []
        self.url = ""
        self._found = threading.Event()
        self.proc: subprocess.Popen[str] | None = None

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def __enter__(self) -> CliServer:
        self.proc = subprocess.Popen([sys.executable, "-m", "lmkit.cli.main", "serve",
                                      *self.args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=self.env)
        pump = threading.Thread(target=self._pump, daemon=True)
        pump.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._found.wait(0.1):
            if not pump.is_alive() or time.monotonic() > deadline:  # exited, or too slow
                self.__exit__()
                raise RuntimeError(f"lmkit serve did not print its URL:\n{self.output}")
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"OpenAI-compatible API at (http://\S+)/v1", line)
            if m:
                self.url = m.group(1)
                self._found.set()

    def wait(self, timeout: float) -> int:
        """The exit status, waiting up to ``timeout`` seconds."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def __exit__(self, *exc: Any) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def engine_pid_gone(pid: int, timeout: float = 10.0) -> bool:
    """True once process ``pid`` has exited (within ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def record_engine_messages(server: LiveServer, monkeypatch: Any) -> list[object]:
    """Every message the API process sends its engine from now on (the list fills as
    they go), for tests that check a request was refused before the engine saw it."""
    client = server.state.llm.client
    sent: list[object] = []
    real_send = client.send

    async def recording_send(message: object) -> None:
        sent.append(message)
        await real_send(message)

    monkeypatch.setattr(client, "send", recording_send)
    return sent
