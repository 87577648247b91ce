"""The engine core's output thread: ZMQ sends leave the step loop.

Pushing a message to the API process is a system call that wakes the ZMQ I/O thread
(and, through it, the reader). Measured in ``lmkit serve`` on a loaded 2-core CPU, a
step's send took 55 us at the median and 261 us on average (the sender is often
descheduled in favour of the thread it wakes), against 7 us to encode the same
message. :class:`OutputSender` owns the PUSH socket from its own thread, so the step
loop only encodes a message and queues the bytes, and goes on to drain input and
schedule the next step while the send runs (pyzmq releases the GIL while sending).

Messages leave in the order they were queued (outputs, rejections, stats, the final
:class:`~lmkit.engine.messages.EngineFailed` all share the one queue).
:meth:`OutputSender.close` sends everything still queued before it returns.
"""

from __future__ import annotations

import queue
import threading

import zmq


class OutputSender:
    """Sends byte strings on ``socket`` from a daemon thread, in queue order.

    From construction on, only this object's thread touches ``socket``; the caller
    closes it after :meth:`close`. A send that fails (the context was terminated)
    ends the thread, and later :meth:`send` calls raise that error.
    """

    def __init__(self, socket: zmq.Socket) -> None:
        self._socket = socket
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()  # None: stop
        self._error: zmq.ZMQError | None = None
        self._thread = threading.Thread(target=self._run, name="lmkit-engine-output",
                                        daemon=True)
        self._thread.start()

    def send(self, data: bytes) -> None:
        """Queue one encoded message; returns at once."""
        if self._error is not None:
            raise self._error
        self._queue.put(data)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread (waits up to ``timeout`` seconds)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            data = self._queue.get()
            if data is None:
                return
            try:
                self._socket.send(data, copy=False)
            except zmq.ZMQError as e:
                self._error = e
                return
