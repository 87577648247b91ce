"""The frontend's side of the engine-core channel: start the process, talk to it, watch it.

The client binds two ZMQ ``ipc://`` sockets in a private temp dir (mode 0700): a PUSH
socket for requests and a PULL socket for outputs. The handshake file there (mode 0600)
holds the configuration without the API key. Sends are ``zmq.asyncio``; receives are
non-blocking reads (a message already waiting is taken at once) and an empty socket is
waited for with the event loop's reader on the socket's FD, so the API process's event
loop never blocks on the engine. One coroutine at a time reads a client. :meth:`EngineCoreClient.recv`
notices within :data:`DEATH_POLL_S` when the engine process has exited and raises
:class:`~lmkit.errors.EngineDeadError`, so nothing waits forever on a dead engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import zmq
import zmq.asyncio

from lmkit.engine.messages import (
    EngineFailed,
    EngineReady,
    FromEngine,
    Shutdown,
    ToEngine,
    make_encoder,
    make_frontend_decoder,
)
from lmkit.errors import EngineDeadError, LMKitError
from lmkit.platform import python_module_command

DEATH_POLL_S = 0.2  # how often a quiet channel checks whether the engine process lives

# secrets the engine process never needs (its environment and the handshake file)
_SECRET_ENV = ("LMKIT_API_KEY", "LMKIT_SERVER__API_KEY")


def engine_command(handshake: Path) -> list[str]:
    """The command line of the engine-core process (the working directory is not on its
    import path)."""
    return python_module_command("lmkit.engine.core_proc", str(handshake))


def engine_config_json(config_json: dict[str, Any]) -> dict[str, Any]:
    """``config_json`` without the server's API key, which the engine does not need."""
    server = {**config_json.get("server", {}), "api_key": None, "api_key_file": None}
    return {**config_json, "server": server}


class EngineStartupError(LMKitError):
    """The engine-core process failed before it was ready; the message says why, and
    :attr:`exit_code` is the one of the engine's own error."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class EngineCoreClient:
    """Owns the engine-core process and both ends of its channel.

    ``config_json`` is ``LMKitConfig.model_dump(mode="json")``; ``env`` adds environment
    variables for the engine process (e.g. ``OMP_NUM_THREADS``).
    """

    def __init__(self, config_json: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.config_json = config_json
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.dead_reason: str | None = None
        self._tmpdir = Path(tempfile.mkdtemp(prefix="lmkit-serve-"))  # 0700
        self._ctx = zmq.asyncio.Context()
        self._encoder = make_encoder()
        self._decoder = make_frontend_decoder()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._to_engine.setsockopt(zmq.LINGER, 0)
        self._to_engine.setsockopt(zmq.SNDHWM, 0)
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._from_engine.setsockopt(zmq.LINGER, 0)
        self.input_addr = f"ipc://{self._tmpdir / 'input.sock'}"
        self.output_addr = f"ipc://{self._tmpdir / 'output.sock'}"
        self._to_engine.bind(self.input_addr)
        self._from_engine.bind(self.output_addr)
        # outputs are read with the blocking API, non-blocking: a waiting message is taken
        # at once, and an empty socket is waited for with the loop's reader on the
        # socket's FD (cheaper than zmq.asyncio's poll, which builds a poller per wait)
        self._from_engine_now: zmq.Socket[bytes] = zmq.Socket.shadow(self._from_engine.underlying)
        self._reader_loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The engine-core process id, once started."""
        return self.proc.pid if self.proc else None

    def is_alive(self) -> bool:
        """False once the engine process has exited or been declared dead."""
        if self.dead_reason is None and self.proc is not None and self.proc.poll() is not None:
            self.dead_reason = f"the engine process exited with status {self.proc.returncode}"
        return self.dead_reason is None

    async def start(self, timeout: float | None = None) -> EngineReady:
        """Start the process and wait for :class:`EngineReady`.

        Raises :class:`EngineStartupError` with the engine's own message if it fails to
        build (bad model, bad config, ...) or exits, and after ``timeout`` seconds.
        """
        handshake = self._tmpdir / "handshake.json"
        fd = os.open(handshake, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"config": engine_config_json(self.config_json),
                       "input_addr": self.input_addr, "output_addr": self.output_addr,
                       "parent_pid": os.getpid()}, f)
        env = {k: v for k, v in {**os.environ, **self.env}.items() if k not in _SECRET_ENV}
        self.proc = subprocess.Popen(engine_command(handshake), env=env,
                                     stdin=subprocess.DEVNULL)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                await self.close(kill=True)
                raise EngineStartupError(
                    f"the engine did not become ready within {timeout:.0f}s; raise the "
                    "startup timeout, or check that the model loads with `lmkit generate`")
            try:
                message = await self.recv(timeout=remaining)
            except EngineDeadError as e:
                raise EngineStartupError(f"the engine process failed to start: {e}") from None
            if message is None:
                continue
            if isinstance(message, EngineReady):
                return message
            if isinstance(message, EngineFailed):
                await self.close(kill=True)
                raise EngineStartupError(f"the engine failed to start: {message.error}",
                                         exit_code=message.exit_code)

    async def send(self, message: ToEngine) -> None:
        """Send one message to the engine; raises EngineDeadError if it is gone."""
        if not self.is_alive():
            raise EngineDeadError(self.dead_reason or "the engine process is not running")
        await self._to_engine.send(self._encoder.encode(message), copy=False)

    async def recv(self, timeout: float | None = None) -> FromEngine | None:
        """The next message from the engine, or None after ``timeout`` seconds.

        Raises :class:`EngineDeadError` once the process has exited (after delivering
        whatever it sent before dying) or after it reported :class:`EngineFailed`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = self._from_engine_now
        while True:
            dead = not self.is_alive()  # still deliver what it sent before dying
            try:  # a waiting message (a busy engine sends one per step): no wait
                return self._decode(sock.recv(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                pass
            if dead:
                raise EngineDeadError(self.dead_reason or "the engine process is not running")
            wait = DEATH_POLL_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return None
            await self._wait_readable(wait)

    async def _wait_readable(self, timeout: float) -> None:
        """Until the output socket may have a message, or ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        if self._reader_loop is not loop:
            self._remove_reader()
            loop.add_reader(self._from_engine_now.FD, self._on_readable)
            self._reader_loop = loop
        # the FD only signals that the socket's state changed, and reading EVENTS re-arms
        # it: a message that came after the recv above shows here, never lost
        if self._has_message():
            return
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _on_readable(self) -> None:
        # reading EVENTS also clears the FD, so the (level-triggered) reader stops firing
        if self._has_message() and self._waiter:
            _resolve(self._waiter)

    def _has_message(self) -> bool:
        events = cast(int, self._from_engine_now.getsockopt(zmq.EVENTS))
        return bool(events & zmq.POLLIN)

    def _remove_reader(self) -> None:
        loop, self._reader_loop = self._reader_loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._from_engine_now.FD)

    def _decode(self, frame: zmq.Frame) -> FromEngine:
        message = self._decoder.decode(frame.buffer)
        if isinstance(message, EngineFailed) and self.dead_reason is None:
            self.dead_reason = f"the engine failed: {message.error}"  # fatal
        return message

    async def close(self, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop the engine (politely unless ``kill``), close the sockets, remove the temp dir."""
        if self._closed:
            return
        self._closed = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            if not kill:
                # NOBLOCK: an engine that is exiting on its own (it failed) has no
                # reader, and a PUSH send with no peer would wait forever
                with contextlib.suppress(zmq.ZMQError):
                    await self._to_engine.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
                await _wait_exit(proc, timeout)
            if proc.poll() is None:
                proc.terminate()
                await _wait_exit(proc, 5.0)
            if proc.poll() is None:
                proc.kill()
                await _wait_exit(proc, 5.0)
        if self.dead_reason is None:
            self.dead_reason = "the engine was shut down"
        self._remove_reader()
        self._to_engine.close()
        self._from_engine.close()
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
