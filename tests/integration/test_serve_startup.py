"""``lmkit serve`` startup on a tiny random-weight Llama: the port opens only once the
engine is warm, the banner says what the KV pool took (and that it is FP8 when asked),
and the API key stays in the API process (not in the engine's command line, environment
or handshake file)."""

from __future__ import annotations

import socket
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_live import CliServer, engine_pid_gone

KEY = "sk-startup-test-6d1c9f"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HealthProbe:
    """Polls ``/health`` from the moment the server starts: what it saw, and whether
    a connection was ever refused (the port not yet bound)."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/health"
        self.statuses: list[int] = []
        self.refused = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.statuses.append(httpx.get(self.url, timeout=2).status_code)
            except httpx.TransportError:
                self.refused += 1
            time.sleep(0.02)


def _proc_text(pid: int, name: str) -> str:
    return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.slow
def test_cli_binds_when_warm_and_keeps_the_key_in_the_api_process(tiny_dir):
    port = _free_port()
    probe = HealthProbe(port)
    probe.thread.start()
    try:
        with CliServer([str(tiny_dir), "--port", str(port), "--served-model-name", "tiny",
                        "--max-num-seqs", "4", "--set", "model.max_model_len=512"],
                       env={"LMKIT_API_KEY": KEY}) as cli:
            probe.stop.set()
            probe.thread.join(5)
            out = cli.output
            # the port was closed while the engine loaded, and never answered "loading"
            assert probe.refused > 0 and set(probe.statuses) <= {200}, probe.statuses
            assert out.index("Uvicorn running") < out.index("OpenAI-compatible API")
            # 4 requests of 512 tokens (32 blocks each) and the null block
            assert "KV cache: " in out and "129 blocks of 16 tokens" in out
            assert "visible to other local users" not in out

            headers = {"Authorization": f"Bearer {KEY}"}
            assert httpx.get(f"{cli.url}/v1/models").status_code == 401
            stack = httpx.get(f"{cli.url}/v1/lmkit/stack", headers=headers).json()
            assert stack["stats"]["num_steps"] >= 1  # the warm-up ran in the engine
            assert "lmkit_requests_total{" not in httpx.get(f"{cli.url}/metrics",
                                                            headers=headers).text

            pid = stack["engine_pid"]
            cmdline = _proc_text(pid, "cmdline")
            assert KEY not in cmdline and KEY not in _proc_text(pid, "environ")
            assert KEY not in _proc_text(cli.proc.pid, "cmdline")
            handshake = Path(cmdline.split()[-1])
            assert handshake.name == "handshake.json" and KEY not in handshake.read_text()
            assert stat.S_IMODE(handshake.stat().st_mode) == 0o600
            assert stat.S_IMODE(handshake.parent.stat().st_mode) == 0o700
    finally:
        probe.stop.set()
    assert engine_pid_gone(pid)


@pytest.mark.slow
def test_cli_reads_the_key_from_a_file(tiny_dir, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    with CliServer([str(tiny_dir), "--port", "0", "--served-model-name", "tiny",
                    "--api-key-file", str(key_file), "--log-level", "warning"]) as cli:
        assert "(API key required)" in cli.output
        assert httpx.get(f"{cli.url}/v1/models").status_code == 401
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        resp = httpx.post(f"{cli.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"})
        assert resp.status_code == 200, resp.text


@pytest.mark.slow
def test_cli_serves_over_an_fp8_kv_cache_and_says_so(tiny_dir):
    with CliServer([str(tiny_dir), "--port", "0", "--served-model-name", "tiny",
                    "--kv-cache-dtype", "fp8", "--max-num-seqs", "4",
                    "--set", "model.max_model_len=512"]) as cli:
        # the same 129 blocks as above, at a quarter of the float32 bytes
        assert "GiB, float8 e4m3, 129 blocks of 16 tokens" in cli.output
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        resp = httpx.post(f"{cli.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
