"""The engine core's output thread: order, flush on close, and a failed send."""

from __future__ import annotations

import tempfile

import pytest
import zmq
from lmkit.engine.output_sender import OutputSender


@pytest.fixture
def channel():
    ctx = zmq.Context()
    addr = f"ipc://{tempfile.mkdtemp(prefix='lmkit-sender-')}/s"
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(addr)
    yield ctx, push, pull
    pull.close()
    push.close()
    ctx.term()


def test_messages_arrive_in_queue_order_and_close_flushes(channel):
    _, push, pull = channel
    sender = OutputSender(push)
    for i in range(500):
        sender.send(b"m%d" % i)
    sender.close()  # everything queued is sent before it returns
    assert not sender._thread.is_alive()
    pull.setsockopt(zmq.RCVTIMEO, 5000)
    assert [pull.recv() for _ in range(500)] == [b"m%d" % i for i in range(500)]


def test_the_thread_keeps_sending_until_closed(channel):
    _, push, pull = channel
    sender = OutputSender(push)
    sender.send(b"x")
    pull.setsockopt(zmq.RCVTIMEO, 5000)
    assert pull.recv() == b"x"
    assert sender._thread.is_alive()
    sender.close()


def test_a_failed_send_is_raised_on_the_next_send(channel):
    ctx, push, _ = channel
    sender = OutputSender(push)
    sender.close()
    bad = ctx.socket(zmq.PUSH)
    bad.close()  # sending on a closed socket raises ZMQError (ENOTSOCK) in the thread
    sender = OutputSender(bad)
    sender.send(b"lost")
    sender._thread.join(5)
    with pytest.raises(zmq.ZMQError):
        sender.send(b"after")
