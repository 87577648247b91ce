"""``lmkit serve --config FILE`` selecting the installed contrib plugins: the running
server reports them in its stack (with distribution versions) and serves completions."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from lmkit.testing.tiny_model import make_tiny_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # starts a server: about 7 s on 2 CPU cores
def test_serve_selects_the_contrib_plugins(subprocess_env, tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "tiny")
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model:\n  model: {model_dir}\n  dtype: float32\n  max_model_len: 128\n"
        "cache:\n  num_blocks: 64\n  block_size: 4\nexecutor:\n  device: cpu\n"
        "scheduler:\n  backend: fair-share\n  options: {tenant_from: priority}\n"
        "structured_output:\n  backend: llguidance\n")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "lmkit.cli.main", "serve", "--config", str(config), "--port",
         str(port), "--log-level", "warning"],
        env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                pytest.fail(f"lmkit serve exited {server.returncode}: {server.stdout.read()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.3)
        stack = httpx.get(f"{url}/v1/lmkit/stack", timeout=10).json()["stack"]
        assert (stack["scheduler"]["name"], stack["scheduler"]["dist"],
                stack["scheduler"]["version"]) == ("fair-share", "lmkit-fair-scheduler", "0.1.0")
        assert stack["scheduler"]["options"]["tenant_from"] == "priority"
        assert (stack["structured_output"]["name"], stack["structured_output"]["version"]) == (
            "llguidance", "0.1.0")
        resp = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": str(model_dir), "prompt": "fair", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "priority": 1})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 5
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
