"""AsyncLLM over two engines (data parallel), each a scripted engine in a thread behind
the real channel: requests spread, aborts reach the engine that runs the request, a dead
engine fails only its own requests while the other serves, and stats are per engine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest
from lmkit.api.sampling_params import SamplingParams
from lmkit.config.schema import LMKitConfig
from lmkit.engine.core_proc import EngineCoreProc
from lmkit.engine.messages import EngineReady
from lmkit.errors import EngineDeadError
from lmkit.frontend.async_llm import AsyncLLM
from lmkit.frontend.core_client import EngineCoreClient
from lmkit.frontend.engine_set import EngineSlot
from test_serve_async_llm import SCRIPT, ScriptedEngine, collect, run


@pytest.fixture
def two_engines(smollm2_tokenizer):
    """(AsyncLLM factory, [scripted engine 0, scripted engine 1], their loops)."""
    engines = [ScriptedEngine(smollm2_tokenizer.encode(SCRIPT)) for _ in range(2)]
    procs: list[tuple[EngineCoreProc, threading.Thread]] = []

    async def make() -> AsyncLLM:
        slots = []
        ready = EngineReady(model_dir="/nonexistent", max_model_len=256, vocab_size=49152,
                            stack={}, plugins=[], stats={})
        for index, engine in enumerate(engines):
            client = EngineCoreClient(LMKitConfig().model_dump(mode="json"))
            proc = EngineCoreProc(engine, client.input_addr, client.output_addr)
            thread = threading.Thread(target=proc.run, daemon=True)
            thread.start()
            procs.append((proc, thread))
            slots.append(EngineSlot(index, client, ready))
        config = LMKitConfig.model_validate({"parallel": {"data_parallel_size": 2}})
        llm = AsyncLLM(slots, ready, config, smollm2_tokenizer)
        llm._start_output_loops()
        return llm

    yield make, engines, procs
    for proc, thread in procs:
        proc.should_stop = True
        thread.join(5)
        proc.close()


def test_requests_spread_and_aborts_reach_their_engine(two_engines):
    make, engines, _ = two_engines

    async def main():
        llm = await make()
        outs = await asyncio.gather(*(collect(llm.generate(f"Hi {i}", SamplingParams(
            max_tokens=3))) for i in range(4)))
        routed = list(llm.engines.router.num_routed)
        # a long request on each engine, then close the second stream
        agens = [llm.generate(f"long {i}", SamplingParams(max_tokens=200)) for i in range(2)]
        for agen in agens:
            await agen.__anext__()
        on = [llm.engines.engine_of(rid) for rid in llm.in_flight.collectors]
        await agens[1].aclose()
        await asyncio.sleep(0.1)
        stats = [await llm.get_stats(engine=e) for e in range(2)]
        aborted = [list(e.aborted) for e in engines]
        await agens[0].aclose()
        await llm.shutdown()
        return outs, routed, on, stats, aborted

    outs, routed, on, stats, aborted = run(main())
    assert all(o[-1].outputs[0].text == " one two three" for o in outs)
    assert routed == [2, 2] and [e.num_added for e in engines] == [3, 3]  # 2 short, 1 long
    assert sorted(on) == [0, 1]
    closed_on = on[1]
    # only the engine that ran the closed request was told to abort it
    assert len(aborted[closed_on]) == 1 and not aborted[1 - closed_on]
    assert stats[closed_on]["num_running_reqs"] == 0
    assert stats[1 - closed_on]["num_running_reqs"] == 1


def test_a_dead_engine_fails_only_its_requests_and_the_other_serves(two_engines):
    make, engines, procs = two_engines

    async def main():
        llm = await make()
        for slot in llm.engines.slots:  # stand-ins for the engine processes
            slot.client.proc = subprocess.Popen([sys.executable, "-c",
                                                 "import time; time.sleep(60)"])
        agens = [llm.generate(f"long {i}", SamplingParams(max_tokens=100)) for i in range(2)]
        for agen in agens:
            await agen.__anext__()
        victim = llm.engines.engine_of(next(iter(llm.in_flight.collectors)))
        procs[victim][0].should_stop = True
        llm.engines.slots[victim].client.proc.kill()
        results = []
        for agen in agens:
            try:
                results.append(len([o async for o in agen]))
            except EngineDeadError as e:
                results.append(str(e))
        await llm.wait_engine_death(victim)
        healthy, can_serve = llm.is_healthy, llm.can_serve
        after = [await collect(llm.generate(f"after {i}", SamplingParams(max_tokens=2)))
                 for i in range(3)]
        survivor = llm.engines.slots[1 - victim]
        routed = list(llm.engines.router.num_routed)
        survivor.client.proc.kill()
        await llm.shutdown()
        return victim, results, healthy, can_serve, after, routed, llm.dead_reason

    victim, results, healthy, can_serve, after, routed, reason = run(main())
    failed = [r for r in results if isinstance(r, str)]
    assert len(failed) == 1 and f"engine {victim}" in failed[0]
    assert not healthy and can_serve
    assert all(o[-1].outputs[0].text == " one two" for o in after)
    assert routed[1 - victim] == 4 and routed[victim] == 1  # all new ones on the survivor
    assert f"engine {victim}" in reason


def test_a_shared_prompt_prefix_stays_on_one_engine(two_engines):
    make, engines, _ = two_engines
    system = "You are a helpful assistant. " * 8  # several 16-token blocks

    async def main():
        llm = await make()
        await collect(llm.generate(system + "Question one?", SamplingParams(max_tokens=2)))
        home = engines[1].num_added  # 0 or 1: where the prefix went
        # a long request pinned there makes `home` the busier engine...
        busy = llm.generate("long", SamplingParams(max_tokens=200), engine=home)
        await busy.__anext__()
        # ...yet the same prefix goes back to it (1 in flight is within the slack)
        rid = "again"
        agen = llm.generate(system + "Question two?", SamplingParams(max_tokens=2),
                            request_id=rid)
        first = await agen.__anext__()
        on = llm.engines.engine_of(rid)
        rest = [o async for o in agen]
        unrelated = llm.generate("Something else entirely. " * 4, SamplingParams(max_tokens=2),
                                 request_id="unrelated")
        await unrelated.__anext__()
        on_unrelated = llm.engines.engine_of("unrelated")
        await unrelated.aclose()
        await busy.aclose()
        hits = llm.engines.router.num_affinity_hits
        await llm.shutdown()
        return home, on, on_unrelated, hits, [first, *rest]

    home, on, on_unrelated, hits, outs = run(main())
    assert outs[-1].finished
    assert on == home and hits == 1
    assert on_unrelated == 1 - home  # no known prefix: the least-loaded engine


def test_offline_data_parallel_refuses_a_running_event_loop_before_starting_engines():
    from lmkit.frontend.dp_engine import DataParallelEngine

    config = LMKitConfig.model_validate({"parallel": {"data_parallel_size": 2},
                                         "model": {"model": "/nonexistent"}})

    async def inside() -> None:
        DataParallelEngine(config)

    with pytest.raises(RuntimeError, match="cannot run inside a running one.*AsyncLLM"):
        asyncio.run(inside())
