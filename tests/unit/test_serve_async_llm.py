"""AsyncLLM and the engine-core channel, driven by a scripted engine in a thread.

The real :class:`EngineCoreProc` loop, ZMQ sockets, msgspec messages, input and output
processors and tokenizer are used; only the model is replaced by a script that emits the
same tokens for every request, so these tests need no weights and take seconds.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest
from lmkit.api.outputs import EngineCoreOutput
from lmkit.api.sampling_params import SamplingParams
from lmkit.config.schema import LMKitConfig
from lmkit.engine.core_proc import EngineCoreProc
from lmkit.engine.messages import EngineReady
from lmkit.errors import EngineDeadError, InvalidRequestError
from lmkit.frontend.async_llm import AsyncLLM
from lmkit.frontend.core_client import EngineCoreClient

SCRIPT = " one two three four five six seven eight nine ten"


class ScriptedEngine:
    """Emits the tokens of SCRIPT one per step to every request (cycling)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.running: dict[str, object] = {}
        self.aborted: list[str] = []
        self.num_added = 0

    def add_request(self, request) -> None:
        if request.prompt_token_ids[0] == 0:  # stands for "the scheduler cannot take it"
            raise InvalidRequestError("prompt starts with token 0", param="prompt",
                                      code="unschedulable")
        self.num_added += 1
        self.running[request.request_id] = request

    def abort_requests(self, request_ids) -> None:
        for rid in request_ids:
            if self.running.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def take_rejected_requests(self) -> list:
        return []  # it decides at add_request

    def step(self) -> list[EngineCoreOutput]:
        time.sleep(0.005)
        outs = []
        for rid, req in list(self.running.items()):
            tok = self.tokens[req.num_output_tokens % len(self.tokens)]
            req.append_output_token_ids([tok])
            done = req.num_output_tokens >= req.max_tokens
            outs.append(EngineCoreOutput(rid, [tok], "length" if done else None))
            if done:
                del self.running[rid]
        return outs

    def stats(self) -> dict[str, float]:
        return {"num_running_reqs": len(self.running), "kv_cache_usage": 0.1 * len(self.running)}


@pytest.fixture
def harness(smollm2_tokenizer):
    """(AsyncLLM factory, scripted engine) with the engine loop running in a thread."""
    engine = ScriptedEngine(smollm2_tokenizer.encode(SCRIPT))
    state = {}

    async def make(observer=None) -> AsyncLLM:
        client = EngineCoreClient(LMKitConfig().model_dump(mode="json"))
        proc = EngineCoreProc(engine, client.input_addr, client.output_addr)
        thread = threading.Thread(target=proc.run, daemon=True)
        thread.start()
        state.update(proc=proc, thread=thread)
        ready = EngineReady(model_dir="/nonexistent", max_model_len=64, vocab_size=49152,
                            stack={}, plugins=[],
                            stats={})
        llm = AsyncLLM(client, ready, LMKitConfig(), smollm2_tokenizer, observer=observer)
        llm._start_output_loops()
        return llm

    make.state = state
    yield make, engine
    if "proc" in state:
        state["proc"].should_stop = True
        state["thread"].join(5)
        state["proc"].close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def collect(agen):
    outs = [o async for o in agen]
    return outs


def test_stream_deltas_concatenate_and_n_fans_out(harness):
    make, engine = harness

    async def main():
        llm = await make()
        outs = await collect(llm.generate("Hi", SamplingParams(n=3, max_tokens=5)))
        await llm.shutdown()
        return outs

    outs = run(main())
    final = outs[-1]
    assert final.finished and len(final.outputs) == 3
    for c in final.outputs:
        assert c.text == " one two three four five" and c.finish_reason == "length"
        assert "".join(o.outputs[c.index].delta_text for o in outs) == c.text
    assert engine.num_added == 3


class Timings:
    """A RequestObserver that records what it is told."""

    def __init__(self) -> None:
        self.first, self.tokens, self.finished = 0, 0, []

    def on_first_token(self, ttft_s: float) -> None:
        self.first += 1

    def on_tokens(self, num_tokens: int, inter_token_s: float) -> None:
        self.tokens += num_tokens

    def on_finish(self, outcome, e2e_s, num_prompt_tokens, num_generated_tokens) -> None:
        self.finished.append((outcome, num_generated_tokens))


def test_delta_outputs_of_a_slow_consumer_concatenate_to_the_text(harness):
    make, _ = harness
    timings = Timings()

    async def main():
        llm = await make(timings)
        outs = []
        async for out in llm.generate("Hi", SamplingParams(n=2, max_tokens=7),
                                      output_kind="delta"):
            outs.append(out)
            await asyncio.sleep(0.012)  # slower than the engine: outputs fold meanwhile
        await llm.shutdown()
        return outs

    outs = run(main())
    assert outs[-1].finished and len(outs) < 7  # some outputs were folded together
    for index in (0, 1):
        parts = [o.outputs[index] for o in outs]
        assert [(c.text, c.token_ids) for c in parts] == [
            (c.delta_text, c.delta_token_ids) for c in parts]
        assert "".join(c.text for c in parts) == " one two three four five six seven"
        assert sum(len(c.token_ids) for c in parts) == 7
    # every token reached the metrics, folded or not
    assert timings.first == 1 and timings.finished == [("length", 14)]
    # The first token is the first engine output's: both children's tokens when the
    # engine took them in one step, one child's when it stepped between their arrivals
    # (a loaded machine). Every other token is counted once.
    assert timings.tokens in (14 - 2, 14 - 1)


def test_final_output_is_one_whole_output_and_the_metrics_see_each_step(harness):
    make, _ = harness
    timings = Timings()

    async def main():
        llm = await make(timings)
        outs = await collect(llm.generate("Hi", SamplingParams(max_tokens=5),
                                          output_kind="final"))
        with pytest.raises(ValueError, match="unknown output kind 'full'; known: "
                                             "cumulative, delta, final"):
            await collect(llm.generate("Hi", SamplingParams(max_tokens=5),
                                       output_kind="full"))
        in_flight = llm.num_in_flight
        await llm.shutdown()
        return outs, in_flight

    outs, in_flight = run(main())
    (out,) = outs
    assert out.finished and in_flight == 0
    assert out.outputs[0].text == " one two three four five"
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].delta_token_ids == []
    assert timings.first == 1 and timings.tokens == 4  # steps 2-5, one token each
    assert timings.finished == [("length", 5)]


def test_stop_string_truncates_and_aborts_in_engine(harness):
    make, engine = harness

    async def main():
        llm = await make()
        outs = await collect(llm.generate("Hi", SamplingParams(max_tokens=10, stop=[" four"])))
        await asyncio.sleep(0.1)
        await llm.shutdown()
        return outs

    outs = run(main())
    assert outs[-1].outputs[0].text == " one two three"
    assert outs[-1].outputs[0].finish_reason == "stop"
    assert len(engine.aborted) == 1  # the engine stopped generating for it


def test_closing_the_stream_aborts_the_request(harness):
    make, engine = harness

    async def main():
        llm = await make()
        agen = llm.generate("Hi", SamplingParams(max_tokens=60))
        first = await agen.__anext__()
        await agen.aclose()
        await asyncio.sleep(0.1)
        in_flight = llm.num_in_flight
        await llm.shutdown()
        return first, in_flight

    first, in_flight = run(main())
    assert not first.finished and in_flight == 0
    assert engine.aborted and not engine.running


def test_engine_rejection_is_an_invalid_request_and_others_go_on(harness):
    make, engine = harness

    async def main():
        llm = await make()
        with pytest.raises(InvalidRequestError) as info:
            await collect(llm.generate([0, 5, 6], SamplingParams(max_tokens=3)))
        outs = await collect(llm.generate("Hi", SamplingParams(max_tokens=2)))
        stats = await llm.get_stats()
        await llm.shutdown()
        return info.value, outs, stats

    err, outs, stats = run(main())
    assert err.code == "unschedulable" and err.param == "prompt"
    assert outs[-1].outputs[0].text == " one two"
    assert stats == {"num_running_reqs": 0.0, "kv_cache_usage": 0.0}


def test_context_length_is_checked_before_the_engine(harness):
    make, engine = harness

    async def main():
        llm = await make()
        with pytest.raises(InvalidRequestError) as info:
            await collect(llm.generate("Hi", SamplingParams(max_tokens=100)))
        await llm.shutdown()
        return info.value

    assert run(main()).code == "context_length_exceeded"
    assert engine.num_added == 0


def test_dead_engine_process_fails_requests_in_flight(harness):
    make, engine = harness
    state = make.state

    async def main():
        llm = await make()
        # Stand-in for the engine process: the client watches it like the real one.
        llm.client.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        agen = llm.generate("Hi", SamplingParams(max_tokens=60))
        await agen.__anext__()
        state["proc"].should_stop = True  # a dead engine sends nothing more
        llm.client.proc.kill()
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in agen:
                pass
        elapsed = time.monotonic() - t0
        healthy = llm.is_healthy
        with pytest.raises(EngineDeadError):
            await collect(llm.generate("Hi", SamplingParams(max_tokens=2)))
        await llm.shutdown()
        return elapsed, healthy

    elapsed, healthy = run(main())
    assert elapsed < 2.0 and not healthy


def test_recv_notices_a_dead_process_quickly():
    async def main():
        client = EngineCoreClient({})
        client.proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="status 3"):
            while True:
                await client.recv(timeout=5)
        elapsed = time.monotonic() - t0
        await client.close(kill=True)
        return elapsed

    assert run(main()) < 5


def test_a_huge_prompt_is_tokenized_off_the_event_loop(harness):
    """Encoding megabytes takes seconds; meanwhile the loop must go on serving."""
    make, engine = harness

    async def main():
        llm = await make()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        start = time.monotonic()
        with pytest.raises(InvalidRequestError) as info:
            await collect(llm.generate("hello world, " * 150_000, SamplingParams(max_tokens=4)))
        elapsed = time.monotonic() - start
        task.cancel()
        await llm.shutdown()
        return info.value, ticks, elapsed

    error, ticks, elapsed = run(main())
    assert error.code == "context_length_exceeded" and engine.num_added == 0
    assert ticks >= elapsed / 0.005 / 4  # the loop ran through most of the encoding


def test_the_output_loop_lets_streams_run_while_a_backlog_drains(smollm2_tokenizer):
    """Behind an engine that is always ahead (a message is waiting at every recv), the
    output loop must still yield to the event loop every OUTPUT_SLICE_S, or every
    stream (and every new request) waits until the backlog empties."""
    from lmkit.engine.messages import EngineOutputs
    from lmkit.frontend import async_llm
    from lmkit.frontend.engine_set import EngineSlot

    class Backlog:  # recv returns at once, like a socket with messages queued
        def __init__(self, n):
            self.left = n

        def is_alive(self):
            return True

        async def recv(self):
            if not self.left:
                raise EngineDeadError("done")
            self.left -= 1
            return EngineOutputs(outputs=[])

    async def main():
        ready = EngineReady(model_dir="/nonexistent", max_model_len=64, vocab_size=49152,
                            stack={}, plugins=[], stats={})
        slot = EngineSlot(0, Backlog(120), ready)
        llm = AsyncLLM([slot], ready, LMKitConfig(), smollm2_tokenizer)
        llm._deliver = lambda message, index=0: time.sleep(0.001)  # 1 ms per message
        beats = []

        async def heartbeat():
            while True:
                beats.append(time.perf_counter())
                await asyncio.sleep(0)

        hb = asyncio.create_task(heartbeat())
        await asyncio.sleep(0)
        start = time.perf_counter()
        await llm._output_loop(0)
        hb.cancel()
        during = [b for b in beats if b > start]
        gaps = [b - a for a, b in zip([start, *during], during, strict=False)]
        return time.perf_counter() - start, during, gaps

    elapsed, during, gaps = asyncio.run(main())
    slice_s = getattr(async_llm, "OUTPUT_SLICE_S", 0.01)
    assert elapsed >= 0.12
    # ~12 slices of 10 ms: the other task ran between them, never waiting much longer
    assert len(during) >= 0.5 * elapsed / slice_s
    assert max(gaps) < 5 * slice_s
