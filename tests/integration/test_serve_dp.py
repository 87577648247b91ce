"""``--dp 2`` on the CPU with the tiny random Llama: two engine processes behind one
server, requests spread over both, per-engine metrics and admin figures, and a killed
engine restarted while the other keeps serving."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from lmkit.config.schema import LMKitConfig
from serve_live import CliServer, LiveServer, engine_pid_gone

pytestmark = pytest.mark.slow  # starts two engine processes, about 15 s


def _body(max_tokens, prompt="Once upon a time"):
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}


def _engines(server):
    resp = httpx.get(f"{server.url}/v1/lmkit/stack")
    resp.raise_for_status()
    return resp.json()["engines"]


def test_dp2_spreads_requests_reports_each_engine_and_survives_a_killed_engine(tiny_dir):
    config = LMKitConfig.model_validate({
        "model": {"model": str(tiny_dir)}, "parallel": {"data_parallel_size": 2},
        "server": {"served_model_name": "tiny", "engine_restart_backoff_s": 1.0}})
    with LiveServer(config) as server, ThreadPoolExecutor(4) as pool:
        engines = _engines(server)
        assert [e["index"] for e in engines] == [0, 1]
        pids = [e["pid"] for e in engines]
        assert len(set(pids)) == 2 and all(e["alive"] for e in engines)

        # different prompts (no shared prefix) at once: the least-loaded engine takes each;
        # long enough that all four are still running when the last is routed (with 16
        # tokens a request could finish first and its engine take a third: [3, 1])
        prompts = [f"{word} upon a time there was" for word in ("Once", "Twice", "Thrice",
                                                                  "Again")]
        futures = [pool.submit(httpx.post, f"{server.url}/v1/completions",
                               json=_body(160, p), timeout=60) for p in prompts]
        for fut in futures:
            resp = fut.result()
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 160
        routed = [e["routed_requests"] for e in _engines(server)]
        # warm-up ran on each engine outside the router; the 4 requests split 2 / 2
        assert routed == [2, 2], routed

        metrics = httpx.get(f"{server.url}/metrics").text
        for engine in ("0", "1"):
            assert f'lmkit_router_requests_total{{engine="{engine}"}} 2.0' in metrics
            assert f'lmkit_num_requests_running{{engine="{engine}"}}' in metrics
            assert f'lmkit_engine_stat{{engine="{engine}",stat="num_steps"}}' in metrics

        # kill engine 1 while a long request runs on each engine
        long = [pool.submit(httpx.post, f"{server.url}/v1/completions",
                            json=_body(1500, f"{w} long story"), timeout=120)
                for w in ("first", "second")]
        deadline = time.monotonic() + 30
        while [e["stats"].get("num_running") for e in _engines(server)] != [1, 1]:
            assert time.monotonic() < deadline, "the long requests never started"
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        while httpx.get(f"{server.url}/health").status_code != 503:
            assert time.monotonic() - killed < 5, "/health still 200 five seconds after"
            time.sleep(0.05)
        assert "engine 1" in httpx.get(f"{server.url}/health").json()["error"]
        # engine 0 serves new requests meanwhile, and its long one finishes
        during = httpx.post(f"{server.url}/v1/completions", json=_body(2), timeout=60)
        assert during.status_code == 200, during.text
        statuses = sorted(f.result(timeout=120).status_code for f in long)
        assert statuses == [200, 503], statuses

        while httpx.get(f"{server.url}/health").status_code != 200:
            assert time.monotonic() - killed < 120, "engine 1 was not restarted"
            time.sleep(0.1)
        engines = _engines(server)
        assert engines[0]["pid"] == pids[0] and engines[1]["pid"] not in (None, pids[1])
        assert all(e["alive"] for e in engines)
        assert "lmkit_engine_restarts_total 1.0" in httpx.get(f"{server.url}/metrics").text
        after = [pool.submit(httpx.post, f"{server.url}/v1/completions",
                             json=_body(8, p), timeout=60) for p in prompts[:2]]
        assert [f.result().status_code for f in after] == [200, 200]
    assert engine_pid_gone(pids[1])


def test_cli_serves_with_dp2_and_says_so(tiny_dir):
    with CliServer([str(tiny_dir), "--port", "0", "--served-model-name", "tiny", "--dp", "2",
                    "--log-level", "warning"]) as cli:
        resp = httpx.post(f"{cli.url}/v1/completions", json=_body(3), timeout=60)
        assert resp.status_code == 200, resp.text
        engines = httpx.get(f"{cli.url}/v1/lmkit/stack").json()["engines"]
        assert len(engines) == 2 and sum(e["routed_requests"] for e in engines) == 1
    assert "per engine, 2 engines (data parallel)" in cli.output, cli.output


def test_offline_llm_with_dp2_spreads_prompts_and_matches_one_engine(tiny_dir):
    from lmkit import LLM, SamplingParams
    from lmkit.errors import EngineDeadError, InvalidRequestError

    prompts = [f"{word} upon a time there was" for word in ("Once", "Twice", "Thrice",
                                                              "Again", "Never", "Always")]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(tiny_dir)) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    with LLM(str(tiny_dir), data_parallel_size=2) as llm:
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == expected  # in order, same tokens
        stats = llm.stats()
        assert stats["data_parallel_size"] == 2 and stats["routed_requests"] == [3, 3]
        # n > 1, a stream closed early (aborted on its engine), then more work
        assert len(llm.generate(prompts[0], SamplingParams(n=2, max_tokens=4))[0].outputs) == 2
        stream = llm.stream(prompts[1], SamplingParams(max_tokens=500, ignore_eos=True))
        next(stream)
        stream.close()
        assert not llm.engine.has_unfinished_requests()
        with pytest.raises(InvalidRequestError):
            llm.generate("hi", SamplingParams(max_tokens=100_000))
        assert llm.generate(prompts[2], params)[0].outputs[0].token_ids == expected[2]
        os.kill(llm.engine.slots[1].client.pid, signal.SIGKILL)  # fails fast, names it
        with pytest.raises(EngineDeadError, match="engine 1 of 2"):
            llm.generate(prompts, SamplingParams(max_tokens=200, ignore_eos=True))
