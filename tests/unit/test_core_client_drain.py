"""EngineCoreClient.recv takes waiting messages without polling, in order, and still
polls (and times out) on an empty channel."""

from __future__ import annotations

import asyncio

import zmq
from lmkit.engine.messages import EngineStats, make_encoder
from lmkit.frontend.core_client import EngineCoreClient


def test_waiting_messages_are_taken_without_a_poll():
    async def main() -> None:
        client = EngineCoreClient({})
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(client.output_addr)
        try:
            encoder = make_encoder()
            for i in range(3):
                push.send(encoder.encode(EngineStats(stats={"i": float(i)}, query_id=i)))
            sync = zmq.Socket.shadow(client._from_engine.underlying)
            while not sync.poll(0):  # the messages have arrived
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            polls = []
            real_poll = client._from_engine.poll

            def counting_poll(*args, **kwargs):
                polls.append(args)
                return real_poll(*args, **kwargs)

            client._from_engine.poll = counting_poll  # type: ignore[method-assign]
            got = [await client.recv(timeout=1.0) for _ in range(3)]
            assert [m.query_id for m in got] == [0, 1, 2]  # type: ignore[union-attr]
            assert polls == []
            assert await client.recv(timeout=0.05) is None  # empty: polls, then times out
            assert polls
        finally:
            push.close(linger=0)
            await client.close()

    asyncio.run(main())
