"""EngineCoreClient.recv takes waiting messages at once, in order, and waits on an empty
channel with the loop's reader: a message that arrives wakes it at once (not at the next
death check), and a quiet channel times out."""

from __future__ import annotations

import asyncio
import time

import zmq
from lmkit.engine.messages import EngineStats, make_encoder
from lmkit.frontend.core_client import DEATH_POLL_S, EngineCoreClient


def _stats(i: int) -> bytes:
    return make_encoder().encode(EngineStats(stats={"i": float(i)}, query_id=i))


def test_waiting_messages_then_wakeups_then_timeout():
    async def main() -> None:
        client = EngineCoreClient({})
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(client.output_addr)
        try:
            for i in range(3):
                push.send(_stats(i))
            got = [await client.recv(timeout=5.0) for _ in range(3)]
            assert [m.query_id for m in got] == [0, 1, 2]  # type: ignore[union-attr]

            t0 = time.monotonic()
            assert await client.recv(timeout=0.05) is None  # quiet: times out
            assert time.monotonic() - t0 < 1.0

            for i in range(3, 23):  # each sent while recv waits: woken by the reader
                asyncio.get_running_loop().call_later(0.01, push.send, _stats(i))
                t0 = time.monotonic()
                message = await client.recv(timeout=5.0)
                assert message.query_id == i  # type: ignore[union-attr]
                assert time.monotonic() - t0 < DEATH_POLL_S
        finally:
            push.close(linger=0)
            await client.close()

    asyncio.run(main())


def test_a_client_serves_a_second_event_loop():
    client = EngineCoreClient({})
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(client.output_addr)
    try:
        for i in range(2):
            async def one(i: int = i) -> int:
                asyncio.get_running_loop().call_later(0.01, push.send, _stats(i))
                message = await client.recv(timeout=5.0)
                return message.query_id  # type: ignore[union-attr,return-value]

            assert asyncio.run(one()) == i
    finally:
        push.close(linger=0)
        asyncio.run(client.close())
