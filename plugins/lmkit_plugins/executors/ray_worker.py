"""One rank of the ``ray`` executor: a :class:`~lmkit_plugins.executors.mp_worker.RankWorker`
inside a Ray actor. Commands and replies cross as msgpack frames (``bytes``), decoded
into the same typed messages as the ``mp`` executor's; Ray carries the frames."""

from __future__ import annotations

import socket
from typing import Any

import msgspec

from lmkit_plugins.executors.mp_messages import worker_decoder
from lmkit_plugins.executors.mp_worker import RankWorker


class RayRank:
    """The actor's class (wrapped with ``ray.remote`` by the executor)."""

    def __init__(self) -> None:
        self.worker: RankWorker | None = None
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = worker_decoder()

    def pid(self) -> int:
        """The actor's process id (for diagnostics)."""
        import os

        return os.getpid()

    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port on it (rank 0: the group's rendezvous)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ip, int(s.getsockname()[1])

    def load(self, handshake: dict[str, Any]) -> bytes:
        """Join the group and load the shard; the encoded :class:`Started` (or
        :class:`Failed`)."""
        self.worker = RankWorker(handshake)
        reply = self._answer(self.worker.load)
        assert reply is not None  # Started or Failed
        return reply

    def call(self, frame: bytes) -> bytes | None:
        """Run one encoded command; the encoded reply (``None`` for no reply)."""
        assert self.worker is not None, "load() first"
        worker = self.worker
        return self._answer(lambda: worker.handle(self.decoder.decode(frame)))

    def _answer(self, fn: Any) -> bytes | None:
        assert self.worker is not None
        try:
            reply = fn()
        except Exception as e:  # the executor raises WorkerFailedError with this text
            reply = self.worker.failed(e)
        return None if reply is None else self.encoder.encode(reply)
