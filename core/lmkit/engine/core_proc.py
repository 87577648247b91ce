"""The engine-core process: one busy loop over ``EngineCore.step()``.

Started by :class:`lmkit.frontend.core_client.EngineCoreClient` (see
:func:`~lmkit.frontend.core_client.engine_command`: the working directory is not on its
import path) with one argument, ``HANDSHAKE_FILE``. The handshake file (JSON, in a
private temp dir) holds the config and the two ZMQ addresses the frontend bound. The
loop reads requests and aborts from a PULL socket without blocking while requests are
running, steps the engine, and hands the encoded outputs to an output thread
(:mod:`lmkit.engine.output_sender`) that pushes them back while the loop schedules the
next step; it blocks on the socket only when the engine is idle. Stats go out periodically so the frontend's metrics stay fresh.

The process exits when told to (:class:`Shutdown` or SIGTERM), when its parent dies, or
with status 1 after sending :class:`EngineFailed` when the engine raises. A watchdog
thread notices a dead parent even while a step is stuck: the loop stops after the step,
and a process not done :data:`ORPHAN_EXIT_S` seconds later ends itself, so a hung engine
never outlives its API process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Protocol

import zmq

from lmkit.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    EngineStats,
    RequestRejected,
    Shutdown,
    StatsQuery,
    make_encoder,
    make_engine_decoder,
    numeric_stats,
)
from lmkit.engine.output_sender import OutputSender
from lmkit.errors import InvalidRequestError, LMKitError

IDLE_POLL_MS = 100  # how long an idle loop waits on the socket before housekeeping
STATS_INTERVAL_S = 0.5
PARENT_CHECK_INTERVAL_S = 1.0
HEALTH_CHECK_INTERVAL_S = 1.0  # while idle, how often the executor's workers are checked
# once the API process is gone, how long the engine may take to finish its step and shut
# down (the executor stops its workers) before the watchdog ends the process
ORPHAN_EXIT_S = 15.0


class StepEngine(Protocol):
    """The part of :class:`lmkit.engine.core.EngineCore` the loop drives."""

    def add_request(self, request: Any) -> None: ...
    def abort_requests(self, request_ids: Any) -> None: ...
    def step(self) -> list[Any]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> dict[str, float | int]: ...
    # optional: ``check_health()``, called about once a second while idle; it raises
    # when the engine can no longer step (EngineCore: a dead executor worker)
    def take_rejected_requests(self) -> list[tuple[str, InvalidRequestError]]:
        """``(request id, error)`` of requests refused after ``add_request`` took them
        (a grammar that did not compile); an engine that decides at ``add_request``
        returns ``[]``."""
        ...


class EngineCoreProc:
    """Drives an engine core from a ZMQ channel until shut down.

    ``input_addr`` is where the frontend's PUSH socket is bound (requests, aborts, stats
    queries); ``output_addr`` where its PULL socket is bound (outputs, rejections, stats).
    """

    def __init__(self, engine: StepEngine, input_addr: str, output_addr: str,
                 parent_pid: int | None = None, ctx: zmq.Context | None = None) -> None:
        self.engine = engine
        self.ctx = ctx or zmq.Context.instance()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 2000)  # let the last outputs leave on exit
        self.output.setsockopt(zmq.SNDHWM, 0)
        self.output.connect(output_addr)
        self.sender = OutputSender(self.output)  # from here on, only its thread sends
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)
        self.encoder = make_encoder()
        self.decoder = make_engine_decoder()
        self.parent_pid = parent_pid
        self.should_stop = False
        self.parent_gone = False
        self._last_stats_at = 0.0
        self._last_stats: dict[str, float] | None = None
        self._closed = threading.Event()
        self._next_health_check = 0.0
        if parent_pid is not None:
            threading.Thread(target=self._watch_parent, name="lmkit-engine-watchdog",
                             daemon=True).start()

    def send(self, message: Any) -> None:
        """Encode one message and queue it for the frontend (the output thread sends)."""
        self.sender.send(self.encoder.encode(message))

    def run(self) -> None:
        """The busy loop: drain input, step while there is work, report stats."""
        was_busy = False
        while not self.should_stop:
            busy = self.engine.has_unfinished_requests()
            self._drain_input(timeout_ms=0 if busy else IDLE_POLL_MS)
            if self.should_stop:
                break
            busy = self.engine.has_unfinished_requests()
            if busy:
                outputs = self.engine.step()
                if outputs:
                    self.send(EngineOutputs(outputs=outputs))
                for rid, error in self.engine.take_rejected_requests():
                    self.send(RequestRejected(request_id=rid, message=str(error),
                                              param=error.param, code=error.code))
            elif time.monotonic() >= self._next_health_check:  # idle: a worker may die
                self._next_health_check = time.monotonic() + HEALTH_CHECK_INTERVAL_S
                check = getattr(self.engine, "check_health", None)  # optional
                if check is not None:
                    check()  # raises: reported as EngineFailed, as a failed step
            # going idle: report at once, so gauges (running, KV usage) settle to idle
            self._maybe_send_stats(force=was_busy and not busy)
            was_busy = busy

    def close(self) -> None:
        """Send what is queued, then close both sockets (pending outputs get LINGER time
        to leave; none when the API process is gone: nobody reads them)."""
        self.sender.close()
        self.input.close()
        if self.parent_gone:
            self.output.setsockopt(zmq.LINGER, 0)
        self.output.close()
        self._closed.set()

    # ----------------------------------------------------------------- input

    def _drain_input(self, timeout_ms: int) -> None:
        if not self.poller.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self.decoder.decode(frame.buffer))
            if self.should_stop:
                return

    def _handle(self, message: Any) -> None:
        if isinstance(message, AddRequest):
            try:
                self.engine.add_request(message.to_request())
            except InvalidRequestError as e:
                # A bad request is refused alone; the engine and other requests go on.
                invalid = e if isinstance(e, InvalidRequestError) else None
                self.send(RequestRejected(request_id=message.request_id, message=str(e),
                                          param=invalid.param if invalid else None,
                                          code=invalid.code if invalid else None))
        elif isinstance(message, AbortRequests):
            self.engine.abort_requests(message.request_ids)
        elif isinstance(message, StatsQuery):
            self.send(EngineStats(stats=numeric_stats(self.engine.stats()),
                                  query_id=message.query_id))
        elif isinstance(message, Shutdown):
            self.should_stop = True

    # ---------------------------------------------------------- housekeeping

    def _maybe_send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats_at < STATS_INTERVAL_S:
            return
        self._last_stats_at = now
        stats = numeric_stats(self.engine.stats())
        # send only on change (ignoring clocks, which always change)
        key = {k: v for k, v in stats.items() if not k.endswith("_s")}
        if force or key != self._last_stats:
            self._last_stats = key
            self.send(EngineStats(stats=stats))

    def _watch_parent(self) -> None:
        """The watchdog thread: once the API process is gone (nobody can read our
        outputs), stop the loop; end the process if it is not closed in time (a step
        that never returns)."""
        while not self._closed.wait(PARENT_CHECK_INTERVAL_S):
            if os.getppid() == self.parent_pid:
                continue
            self.parent_gone = self.should_stop = True
            if self._closed.wait(ORPHAN_EXIT_S):
                return
            print(f"lmkit engine core: the API process (pid {self.parent_pid}) is gone and "
                  f"the engine did not stop within {ORPHAN_EXIT_S:g}s (a step is stuck); "
                  "exiting", file=sys.stderr, flush=True)
            os._exit(1)


def _plugin_rows(host: Any) -> list[dict[str, Any]]:
    return [
        {"name": p.name, "source": p.source, "dist": p.dist, "version": p.version,
         "status": p.status, "error": p.error}
        for p in host.plugins.values()
    ]


def _ready_message(engine: Any, host: Any) -> EngineReady:
    from lmkit.engine.pooling_phase import sentence_transformers_pooler

    facts = engine.facts
    return EngineReady(
        model_dir=str(engine.model_dir),
        max_model_len=facts.max_model_len,
        vocab_size=facts.vocab_size,
        eos_token_ids=list(facts.eos_token_ids),
        generates=facts.generates,
        # as the engine's PoolingPhase: a sentence-transformers export's mode, else the class's
        default_pooler=(sentence_transformers_pooler(engine.model_dir)
                        or facts.pooling.default_pooler),
        stack=engine.stack.as_dict(),
        plugins=_plugin_rows(host),
        stats=numeric_stats(engine.stats()),
        logits_processors=host.registry.names("logits_processor"),
    )


def serve_engine_core(handshake_file: Path) -> int:
    """Build the engine from the handshake, report readiness, run the loop; exit status."""
    from lmkit.config.schema import LMKitConfig
    from lmkit.engine.core import EngineCore
    from lmkit.plugin_host.manager import PluginHost

    handshake = json.loads(handshake_file.read_text())
    config = LMKitConfig.model_validate(handshake["config"])
    ctx = zmq.Context()
    early = ctx.socket(zmq.PUSH)  # to report a failure before the loop exists
    early.setsockopt(zmq.LINGER, 2000)
    early.connect(handshake["output_addr"])
    encoder = make_encoder()
    try:
        host = PluginHost.load(config.plugins)
        engine = EngineCore(config, host, require_tokenizer=True)
    except BaseException as e:  # report every startup failure, then exit
        early.send(encoder.encode(EngineFailed(error=_describe(e), error_type=type(e).__name__,
                                               exit_code=getattr(e, "exit_code", 1))))
        early.close()
        return 1
    early.close()

    proc = EngineCoreProc(engine, handshake["input_addr"], handshake["output_addr"],
                          parent_pid=handshake.get("parent_pid"), ctx=ctx)

    def on_sigterm(signum: int, frame: Any) -> None:
        proc.should_stop = True

    signal.signal(signal.SIGTERM, on_sigterm)
    status = 0
    try:
        proc.send(_ready_message(engine, host))
        proc.run()
    except BaseException as e:
        proc.send(EngineFailed(error=_describe(e), error_type=type(e).__name__))
        traceback.print_exc()
        status = 1
    finally:
        try:
            engine.shutdown()
        finally:
            proc.close()
            ctx.term()
            if proc.parent_gone:  # nobody else will remove the channel's directory
                shutil.rmtree(handshake_file.parent, ignore_errors=True)
    return status


def _describe(e: BaseException) -> str:
    if isinstance(e, LMKitError):
        return str(e)
    return "".join(traceback.format_exception_only(type(e), e)).strip()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the engine-core process (``python -m lmkit.engine.core_proc FILE``)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m lmkit.engine.core_proc HANDSHAKE_FILE "
                 "(started by the lmkit server; not meant to be run by hand)")
    # Ctrl-C reaches the whole process group; the API process decides how to stop us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(serve_engine_core(Path(argv[0])))


if __name__ == "__main__":
    main()
