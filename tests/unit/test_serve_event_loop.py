"""server.event_loop / server.http: uvloop and httptools when installed, clear errors
when asked for and missing."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from lmkit.config.schema import ServerConfig
from lmkit.errors import ConfigError
from lmkit.serve import event_loop
from lmkit.serve.event_loop import resolve_event_loop, resolve_http, run_in_loop


def _installed(monkeypatch, *modules: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(event_loop.importlib.util, "find_spec",
                        lambda name: object() if name in modules else
                        (None if name in ("uvloop", "httptools") else real(name)))


def test_auto_picks_the_fast_ones_when_installed(monkeypatch):
    _installed(monkeypatch, "uvloop", "httptools")
    assert resolve_event_loop(ServerConfig()) == "uvloop"
    assert resolve_http(ServerConfig()) == "httptools"


def test_auto_falls_back_to_asyncio_and_h11(monkeypatch):
    _installed(monkeypatch)
    assert resolve_event_loop(ServerConfig()) == "asyncio"
    assert resolve_http(ServerConfig()) == "h11"


def test_explicit_choices_are_kept(monkeypatch):
    _installed(monkeypatch, "uvloop", "httptools")
    server = ServerConfig(event_loop="asyncio", http="h11")
    assert (resolve_event_loop(server), resolve_http(server)) == ("asyncio", "h11")


@pytest.mark.parametrize(("key", "module", "fallback"),
                         [("event_loop", "uvloop", "asyncio"), ("http", "httptools", "h11")])
def test_asking_for_a_missing_one_says_how_to_fix(monkeypatch, key, module, fallback):
    _installed(monkeypatch)
    resolve = resolve_event_loop if key == "event_loop" else resolve_http
    with pytest.raises(ConfigError) as info:
        resolve(ServerConfig(**{key: module}))
    message = str(info.value)
    assert f"server.{key}={module}" in message and "lmkit[fast-serve]" in message
    assert f"server.{key}={fallback}" in message


def test_unknown_value_is_refused():
    with pytest.raises(ValueError, match="event_loop"):
        ServerConfig(event_loop="tokio")


def test_run_in_loop_runs_on_asyncio():
    async def main() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_in_loop("asyncio", main()).startswith("asyncio")


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed")
def test_run_in_loop_runs_on_uvloop():
    async def main() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_in_loop("uvloop", main()).startswith("uvloop")
