"""One rank of the ``mp`` executor: a process that joins the ``torch.distributed`` group,
loads its shard of the model into a :class:`~lmkit.api.ModelRunner` and runs what the
executor sends it until told to stop.

Started by :class:`~lmkit_plugins.executors.mp.MultiprocExecutor` as
``python -P -m lmkit_plugins.executors.mp_worker HANDSHAKE.json`` (``-P``: the working
directory is not on ``sys.path``). The handshake (JSON) holds the configuration, the
resolved stack's names, the engine's model facts, the rank, the world size, the group's rendezvous address and
the two ZMQ addresses (commands in, replies out). A worker whose engine process is gone
exits on its own, even when it is stuck in a step or a collective (a watchdog thread,
:func:`watch_parent`); one that fails sends :class:`Failed` and exits with status 1. On
``SIGUSR1`` a worker prints every thread's stack to its stderr (the executor asks for
it before it kills a hung rank).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import zmq

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
    facts_from_json,
    worker_decoder,
)

PARENT_POLL_MS = 1000  # how often an idle worker checks that its engine is still there
# once the engine is gone, how long the worker may take to exit on its own (the step it
# runs, then its loop's check) before the watchdog ends the process (a step or a
# collective stuck waiting on a peer that will never come)
ORPHAN_EXIT_S = 3.0
# a rank waiting in a collective for a peer that died gives up after this long (the
# executor has noticed the death and killed the group long before)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def stack_config(config: Any, names: dict[str, str | None]) -> Any:
    """``config`` with every stack kind pinned to the name the executor's process chose,
    so that this process resolves the same stack (``None``: the feature is off)."""
    update = {kind: getattr(config, kind).model_copy(
        update={"backend": name if name is not None else "none"}) for kind, name in names.items()}
    return config.model_copy(update=update)


def init_group(rank: int, world_size: int, init_method: str, device: str,
               cuda_index: int) -> Any:
    """Join the group: gloo on the CPU, NCCL on CUDA (this rank on ``cuda:cuda_index``)."""
    import torch
    import torch.distributed as dist

    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(cuda_index)
        backend = "nccl"
    dist.init_process_group(backend, init_method=init_method, world_size=world_size,
                            rank=rank, timeout=COLLECTIVE_TIMEOUT)
    return dist.group.WORLD


class RankWorker:
    """Holds the runner of one rank and answers the executor's commands, whatever
    carries them (ZMQ here, Ray actor calls in :mod:`~lmkit_plugins.executors.ray_worker`).

    ``handshake``: ``rank``, ``world_size``, ``init_method``, ``config`` (JSON),
    ``stack`` (names by kind), ``facts`` (the engine's model facts,
    :func:`~lmkit_plugins.executors.mp_messages.facts_to_json`) and optionally
    ``cuda_index`` (default: the rank).
    """

    def __init__(self, handshake: dict[str, Any]) -> None:
        self.rank = int(handshake["rank"])
        self.world_size = int(handshake["world_size"])
        self.handshake = handshake
        self.runner: Any = None

    def load(self) -> Started:
        """Join the group, load this rank's shard; the :class:`Started` reply."""
        import torch
        from lmkit.api import LMKitConfig, ModelInfo, ModelRunner, PluginHost, resolve_stack

        hs = self.handshake
        config = LMKitConfig.model_validate(hs["config"])
        host = PluginHost.load(config.plugins)
        stack = resolve_stack(stack_config(config, hs["stack"]), host)
        group = None
        if self.world_size > 1:
            group = init_group(self.rank, self.world_size, hs["init_method"], stack.device,
                               int(hs.get("cuda_index", self.rank)))
        torch.manual_seed(config.model.seed)  # every rank samples alike from equal logits
        runner = ModelRunner(config, stack, host, facts_from_json(hs["facts"]),
                             tp_rank=self.rank, tp_size=self.world_size, tp_group=group)
        runner.load_model()
        self.runner = runner
        return Started(self.rank, ModelInfo(
            kv_bytes_per_block=runner.kv_bytes_per_block(),
            available_kv_bytes=runner.available_kv_bytes(), device=str(runner.device),
            dtype=stack.dtype, num_lookahead_slots=runner.num_lookahead_slots,
            kv_window=runner.kv_window()))

    def handle(self, message: Any) -> Any:
        """Run one command; its reply (``None``: no reply, a rank other than 0 after a
        step)."""
        from lmkit.api import runner_output_to_wire, scheduler_output_from_wire

        runner = self.runner
        if isinstance(message, Execute):
            out = runner.execute_model(scheduler_output_from_wire(message.scheduler_output))
            if self.rank == 0:  # every rank sampled the same tokens; one answers
                return Executed(self.rank, message.seq, runner_output_to_wire(out))
            return None
        if isinstance(message, InitKVCache):
            from lmkit.api import freeze_startup_heap

            runner.initialize_kv_cache(message.num_blocks)
            # the rank's startup heap (shard, graphs) out of later full collections,
            # which would stall this rank's steps and every rank waiting on it
            freeze_startup_heap()
        elif isinstance(message, OffloadLookup):
            held, resident = runner.offload_lookup(message.block_hashes)
            return Looked(self.rank, message.seq, held, resident)
        elif isinstance(message, OffloadStats):
            return Stats(self.rank, message.seq, runner.offload_stats())
        elif isinstance(message, CloseOffload):
            runner.close_offload()
        elif isinstance(message, Stop):
            from lmkit.api import unfreeze_heap

            unfreeze_heap()
            self.runner = None
        return Done(self.rank, message.seq)

    def failed(self, e: BaseException) -> Failed:
        """The :class:`Failed` reply describing ``e``."""
        text = "".join(traceback.format_exception_only(type(e), e)).strip()
        return Failed(self.rank, text, type(e).__name__)


class Worker(RankWorker):
    """A rank driven over ZMQ by the ``mp`` executor."""

    def __init__(self, handshake: dict[str, Any]) -> None:
        super().__init__(handshake)
        self.parent_pid = int(handshake["parent_pid"])
        self.ctx = zmq.Context()
        self.commands = self.ctx.socket(zmq.PULL)
        self.commands.setsockopt(zmq.LINGER, 0)
        self.commands.connect(handshake["command_addr"])
        self.replies = self.ctx.socket(zmq.PUSH)
        self.replies.setsockopt(zmq.LINGER, 2000)  # a last Failed must get out
        self.replies.connect(handshake["reply_addr"])
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = worker_decoder()

    def send(self, message: Any) -> None:
        self.replies.send(self.encoder.encode(message), copy=False)

    def run(self) -> None:
        """Answer commands until :class:`Stop`, or until the engine process is gone."""
        poller = zmq.Poller()
        poller.register(self.commands, zmq.POLLIN)
        while True:
            if not poller.poll(PARENT_POLL_MS):
                if not _alive(self.parent_pid):
                    return
                continue
            message = self.decoder.decode(self.commands.recv(copy=False).buffer)
            reply = self.handle(message)
            if reply is not None:
                self.send(reply)
            if isinstance(message, Stop):
                return

    def close(self) -> None:
        self.runner = None
        self.commands.close()
        self.replies.close()
        self.ctx.term()


def watch_parent(parent_pid: int, rank: int, interval_s: float = PARENT_POLL_MS / 1000,
                 grace_s: float = ORPHAN_EXIT_S) -> threading.Thread:
    """Start a daemon thread that ends this process ``grace_s`` seconds after the engine
    process ``parent_pid`` is gone, if the worker has not exited by then."""

    def watch() -> None:
        while _alive(parent_pid):
            time.sleep(interval_s)
        time.sleep(grace_s)  # a worker that is not stuck exits meanwhile, cleanly
        print(f"lmkit mp worker rank {rank}: the engine process {parent_pid} is gone and "
              f"this rank is stuck; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    thread = threading.Thread(target=watch, name="lmkit-worker-watchdog", daemon=True)
    thread.start()
    return thread


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid


def main(argv: list[str] | None = None) -> int:
    """Run one rank from the handshake file named in ``argv``; the exit status."""
    args = sys.argv[1:] if argv is None else argv
    handshake = json.loads(Path(args[0]).read_text())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stacks of a hung rank
    worker = Worker(handshake)
    watch_parent(worker.parent_pid, worker.rank)
    status = 0
    try:
        worker.send(worker.load())
        worker.run()
    except BaseException as e:  # report every failure to the executor, then exit
        worker.send(worker.failed(e))
        traceback.print_exc()
        status = 1
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized() and status == 0:
                dist.destroy_process_group()
        finally:
            worker.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
