"""The ``mp`` executor: one worker process per tensor-parallel rank on this host.

Each rank (:mod:`lmkit_plugins.executors.mp_worker`) is a fresh interpreter
(``python -P -m ...``: nothing is inherited or pickled, and the working directory is
not on ``sys.path``) that joins a ``torch.distributed`` group (gloo on the CPU, NCCL on
CUDA) and holds a :class:`~lmkit.api.ModelRunner` over its shard of the model. Each
step's :class:`~lmkit.api.SchedulerOutput` is encoded once (msgspec, msgpack) and
pushed to every rank over ZMQ; every rank runs the step (the logits are gathered on
every rank, so they sample the same tokens) and rank 0 answers.

Health: while waiting for an answer the executor polls the worker processes every
:data:`POLL_S` seconds; a rank that exited (killed, crashed) or reported a failure makes
the call raise :class:`WorkerFailedError` at once (the engine then fails: ``/health``
turns 503 and in-flight requests get an error), and the remaining ranks are killed,
since they may be blocked in a collective with the dead one. A step with no answer
within ``execute_timeout_s`` (:class:`~lmkit_plugins.executors.failure.WorkerOptions`)
counts as hung: the ranks print their stacks (``SIGUSR1``, :mod:`faulthandler`), are
killed, and the call raises :class:`WorkerFailedError` too. Workers whose executor is
gone (its process was killed, or exited without :meth:`MultiprocExecutor.shutdown`)
exit on their own; at interpreter exit the executor kills the ranks it still runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq
from lmkit.api import (
    Executor,
    LMKitConfig,
    ModelFacts,
    ModelInfo,
    ModelRunnerOutput,
    PluginHost,
    ResolvedStack,
    SchedulerOutput,
    across_ranks,
    load_model_facts,
    runner_output_from_wire,
    scheduler_output_to_wire,
)

from lmkit_plugins.executors.failure import WorkerFailedError, execute_timeout
from lmkit_plugins.executors.mp_messages import (
    CloseOffload,
    Done,
    Execute,
    Executed,
    Failed,
    InitKVCache,
    Looked,
    OffloadLookup,
    OffloadStats,
    Started,
    Stats,
    Stop,
    executor_decoder,
    facts_to_json,
)

POLL_S = 0.1  # how often a waiting executor checks that every worker is alive
DEATH_GRACE_S = 0.5  # after a rank fails, how long to look for a peer whose death caused it
STOP_GRACE_S = 5.0  # how long a worker gets to exit after Stop before it is killed
STACK_DUMP_S = 0.5  # how long hung workers get to print their stacks before the kill
REAP_S = 5.0  # how long a killed worker may take to be reaped (one stuck in the kernel)

__all__ = ["MultiprocExecutor", "WorkerFailedError", "worker_facts"]


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_facts(config: LMKitConfig, host: PluginHost | None,
                 facts: ModelFacts | None) -> dict[str, Any]:
    """The engine's model facts as the workers' handshakes carry them; derived from
    ``config`` (as the engine does) when the executor was given none."""
    if facts is None:
        host = host if host is not None else PluginHost.load(config.plugins)
        facts = load_model_facts(Path(config.model.model), host, config.model.max_model_len)
    return facts_to_json(facts)


class MultiprocExecutor(Executor):
    """``parallel.tensor_parallel_size`` worker processes, driven over ZMQ.

    Args: as every executor (see :class:`~lmkit.api.Executor`); ``options``: a
    :class:`~lmkit_plugins.executors.failure.WorkerOptions` (``None``: the defaults). The
    workers use ``facts`` (derived from ``config`` when not given); ``host`` serves only
    that: each worker loads its own plugin host from ``config.plugins`` and resolves the
    same stack by name.
    """

    def __init__(self, config: LMKitConfig, stack: ResolvedStack, *, options: Any = None,
                 host: PluginHost | None = None, facts: ModelFacts | None = None) -> None:
        self.config = config
        self.stack = stack
        self.options = options
        self.host = host
        self.facts = facts
        self.world_size = config.parallel.tensor_parallel_size
        self.procs: list[subprocess.Popen[bytes]] = []
        self._tmpdir: Path | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._commands: list[zmq.Socket[Any]] = []
        self._replies: zmq.Socket[Any] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = executor_decoder()
        self._seq = 0
        self._failed: str | None = None
        self.execute_timeout_s = execute_timeout(options)
        # kills the ranks and removes the channel's directory at interpreter exit when
        # shutdown() was never called (workers would otherwise outlive it for a while)
        self._cleanup = weakref.finalize(self, _kill_and_remove, self.procs, None)

    # ------------------------------------------------------------------ start

    def start(self) -> ModelInfo:
        """Start every rank, wait until each has loaded its shard; rank 0's facts with the
        smallest KV budget of all ranks (every rank holds the same number of blocks)."""
        try:
            return self._start()
        except BaseException:
            self.shutdown()  # ranks already started, the sockets, the directory
            raise

    def _start(self) -> ModelInfo:
        self._tmpdir = Path(tempfile.mkdtemp(prefix="lmkit-mp-"))
        self._cleanup.detach()
        self._cleanup = weakref.finalize(self, _kill_and_remove, self.procs, self._tmpdir)
        self._ctx = zmq.Context()
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(f"ipc://{self._tmpdir}/replies")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        facts = worker_facts(self.config, self.host, self.facts)
        for rank in range(self.world_size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            addr = f"ipc://{self._tmpdir}/commands-{rank}"
            sock.bind(addr)
            self._commands.append(sock)
            handshake = self._tmpdir / f"rank-{rank}.json"
            handshake.write_text(json.dumps({
                "rank": rank, "world_size": self.world_size, "init_method": init_method,
                "config": self.config.model_dump(mode="json"), "stack": self.stack.names(),
                "facts": facts, "command_addr": addr, "reply_addr": f"ipc://{self._tmpdir}/replies",
                "parent_pid": os.getpid()}))
            self.procs.append(subprocess.Popen(
                [sys.executable, "-P", "-m", "lmkit_plugins.executors.mp_worker", str(handshake)],
                stdin=subprocess.DEVNULL, env=self._worker_env(rank)))
        started: dict[int, ModelInfo] = {}
        while len(started) < self.world_size:
            reply = self._recv(None)
            if isinstance(reply, Started):
                started[reply.rank] = reply.info
        return across_ranks([started[r] for r in range(self.world_size)])

    def _worker_env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        if self.world_size > 1 and self.stack.device == "cpu":
            # ranks share this host's cores: one thread each unless told otherwise
            env.setdefault("OMP_NUM_THREADS", "1")
        return env

    # ------------------------------------------------------------------ channel

    def _broadcast(self, make: Callable[[int], Any]) -> int:
        """Send ``make(seq)`` (encoded once) to every rank; the sequence number."""
        if self._failed is not None:
            raise WorkerFailedError(self._failed)
        if not self._commands:
            raise RuntimeError("MultiprocExecutor.start() must be called first")
        self._seq += 1
        frame = self._encoder.encode(make(self._seq))
        for sock in self._commands:
            sock.send(frame, copy=False)
        return self._seq

    def _recv(self, seq: int | None, timeout_s: float | None = None) -> Any:
        """The next reply (to ``seq``, or a :class:`Started`), checking every
        :data:`POLL_S` that every worker is alive; raises when one failed or exited, or
        when nothing answered ``seq`` within ``timeout_s`` seconds (a hung rank)."""
        assert self._replies is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._replies.poll(int(POLL_S * 1000)):
                reply = self._decoder.decode(self._replies.recv(copy=False).buffer)
                if isinstance(reply, Failed):
                    failed = f"worker rank {reply.rank} failed: {reply.error}"
                    # a rank fails in a collective when a peer died: name the peer first
                    # (only one that died abruptly: a rank that raised first reports its
                    # own error, and its peers fail in the collective after it)
                    died = self._exited(wait_s=DEATH_GRACE_S, but=reply.rank, killed=True)
                    self._fail(f"{died} (then {failed})" if died else failed)
                if seq is None or getattr(reply, "seq", None) == seq:
                    return reply
                continue  # an answer to an earlier command: nothing waits for it
            died = self._exited()
            if died:
                self._fail(died)
            if deadline is not None and time.monotonic() >= deadline:
                self._dump_stacks()
                self._fail(f"the workers did not answer command {seq} within "
                           f"{timeout_s:g}s (executor.options.execute_timeout_s): a rank "
                           "is hung (a stuck device or collective, a deadlock; the ranks "
                           "still running printed their stacks); raise the timeout if "
                           "steps legitimately take longer")

    def _exited(self, wait_s: float = 0.0, but: int | None = None,
                killed: bool = False) -> str | None:
        """Which worker exited (other than rank ``but``; with ``killed``, only one that a
        signal ended), waiting up to ``wait_s`` for one to be reaped; ``None`` when all
        are running."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs):
                status = proc.poll()
                if status is not None and rank != but and (status < 0 or not killed):
                    how = (f"was killed by signal {-status}" if status < 0
                           else f"exited with status {status}")
                    return f"worker rank {rank} (pid {proc.pid}) {how}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _dump_stacks(self) -> None:
        """Ask every running rank to print its threads' stacks to its stderr (the
        workers register :mod:`faulthandler` on ``SIGUSR1``), and give them the time."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
        time.sleep(STACK_DUMP_S)

    def _fail(self, reason: str) -> None:
        self._failed = (f"{reason}; the {self.world_size}-rank model cannot go on (the "
                        "other ranks were stopped). See the worker's log above.")
        self._kill_all()
        raise WorkerFailedError(self._failed)

    def _gather(self, seq: int, kind: type[Any], timeout_s: float | None = None
                ) -> list[Any]:
        """One reply of type ``kind`` to ``seq`` from every rank, in rank order (all
        within ``timeout_s`` seconds)."""
        got: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(got) < self.world_size:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            reply = self._recv(seq, left)
            if isinstance(reply, kind):
                got[reply.rank] = reply
        return [got[r] for r in range(self.world_size)]

    # ------------------------------------------------------------------ Executor

    def check_health(self) -> None:
        """Raise :class:`WorkerFailedError` when a rank exited or was killed since the
        last step (the other ranks are stopped), or the executor failed before."""
        if self._failed is not None:
            raise WorkerFailedError(self._failed)
        gone = self._exited()
        if gone is not None:
            self._fail(f"{gone} while the engine was idle")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks on every rank (each of its own KV heads)."""
        self._gather(self._broadcast(lambda s: InitKVCache(s, num_blocks)), Done)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's output."""
        wire = scheduler_output_to_wire(scheduler_output)
        seq = self._broadcast(lambda s: Execute(s, wire))
        deadline = None if self.execute_timeout_s is None else (
            time.monotonic() + self.execute_timeout_s)
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            reply = self._recv(seq, left)
            if isinstance(reply, Executed):
                return runner_output_from_wire(reply.output)

    def offload_lookup(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """The smallest ``(held, resident)`` over ranks (a block counts only when every
        rank holds its share)."""
        hashes = list(block_hashes)
        answers = self._gather(self._broadcast(lambda s: OffloadLookup(s, hashes)), Looked,
                               self.execute_timeout_s)
        return min(a.held for a in answers), min(a.resident for a in answers)

    def offload_stats(self) -> dict[str, int]:
        """Every rank's offload counters, summed."""
        total: dict[str, int] = {}
        for answer in self._gather(self._broadcast(OffloadStats), Stats,
                                   self.execute_timeout_s):
            for k, v in answer.stats.items():
                total[k] = total.get(k, 0) + v
        return total

    def close_offload(self) -> None:
        """Close the tier on every rank; nothing once shut down or failed."""
        if self._commands and self._failed is None:
            self._gather(self._broadcast(CloseOffload), Done)

    def shutdown(self) -> None:
        """Stop every rank (killed after :data:`STOP_GRACE_S`), close the channel.
        Safe to call twice, and after a failure."""
        if self._commands and self._failed is None:
            try:
                self._broadcast(Stop)
                deadline = time.monotonic() + STOP_GRACE_S
                for proc in self.procs:
                    try:
                        proc.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
            except (WorkerFailedError, zmq.ZMQError):
                pass
        self._kill_all()
        for sock in self._commands:
            sock.close()
        self._commands = []
        if self._replies is not None:
            self._replies.close()
            self._replies = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._cleanup()  # the directory (and, already done, the kill)
        self._tmpdir = None

    def _kill_all(self) -> None:
        _kill_and_remove(self.procs, None)


def _kill_and_remove(procs: list[subprocess.Popen[bytes]], tmpdir: Path | None) -> None:
    """Kill the workers still running, reap them (each at most :data:`REAP_S`), remove
    the channel's directory."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(REAP_S)
        except subprocess.TimeoutExpired:  # stuck in the kernel: nothing more to do
            print(f"lmkit: worker pid {proc.pid} did not exit after SIGKILL",
                  file=sys.stderr)
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)
