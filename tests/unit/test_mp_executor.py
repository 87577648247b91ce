"""The ``mp`` executor on the CPU (gloo): the same tokens as ``uniproc`` at TP=1 and
TP=2, and a dead worker fails the call fast instead of hanging.

Each test starts worker processes (a fresh interpreter that imports torch), hence slow.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from lmkit.api import SamplingParams
from lmkit.plugin_host.manager import PluginHost
from lmkit.testing.executor import check_executor
from lmkit.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mp"))


@pytest.fixture(scope="module")
def host():
    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})


@pytest.mark.parametrize("tp", [1, 2])
def test_mp_tokens_equal_uniproc(host, model_dir, tp):
    """Executor conformance (chunked prefill, prefix hits, preemption, greedy and seeded
    sampling): every step's sampled token ids equal uniproc's, with the model whole in
    one worker (tp=1) or split over two (tp=2, gloo all-reduce and all-gather)."""
    results = check_executor(host.registry.get("executor", "mp"), model_dir=model_dir,
                             parallel={"tensor_parallel_size": tp})
    assert set(results.values()) == {"passed"}


@pytest.fixture(scope="module")
def uneven_model_dir(tmp_path_factory):
    """6 query heads over 3 KV heads (SmolLM2's 3:1 grouping): 2 ranks hold 2 and 1
    KV groups."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-uneven"), hidden_size=96,
                           num_heads=6, num_kv_heads=3)


def test_uneven_kv_heads_tp2_tokens_equal_uniproc(host, uneven_model_dir):
    """KV heads that do not divide by the size: rank 0 holds 2 KV groups (4 query heads),
    rank 1 one (2); every step's tokens equal uniproc's through chunked prefill, prefix
    hits, preemption and seeded sampling."""
    results = check_executor(host.registry.get("executor", "mp"), model_dir=uneven_model_dir,
                             parallel={"tensor_parallel_size": 2})
    assert set(results.values()) == {"passed"}


def test_uneven_kv_heads_tp3_of_3_and_llm_greedy(uneven_model_dir):
    """Through LLM: --tp 2 (uneven) and --tp 3 (one KV group each) give --tp 1's greedy
    tokens; the KV pool holds the blocks of the rank with the most heads."""
    from lmkit.frontend.llm import LLM

    prompts = ["hello there", "an uneven split of heads over ranks", "x"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs, blocks = {}, {}
    for tp in (1, 2, 3):
        with LLM(str(uneven_model_dir), device="cpu", dtype="float32", attention="torch",
                 tensor_parallel_size=tp, kv_cache_memory_gb=0.01, progress=False) as llm:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            blocks[tp] = llm.engine.num_blocks
    assert outs[2] == outs[1] and outs[3] == outs[1]
    # the same memory budget per rank: rank 0 of tp=2 holds 2 of 3 KV heads per block,
    # so 3/2 of tp=1's blocks fit; with tp=3 each rank holds one (3x)
    assert blocks[2] == pytest.approx(1.5 * blocks[1], rel=0.02)
    assert blocks[3] == pytest.approx(3 * blocks[1], rel=0.02)


def test_uneven_split_with_qkv_bias_matches_tp1(tmp_path):
    """A Qwen2-style model (q/k/v biases, cut at the same heads as the weights) with 3 KV
    heads: --tp 2's tokens equal --tp 1's and its prompt logprobs agree to 1e-4."""
    import torch
    from lmkit.frontend.llm import LLM
    from lmkit.testing.tiny_model import make_byte_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=320, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=256, bos_token_id=257, initializer_range=0.3))
    with torch.no_grad():  # HF initialises biases to zero: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    make_byte_tokenizer().save_pretrained(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=5)
    outs = {}
    for tp in (1, 2):
        with LLM(str(tmp_path), device="cpu", dtype="float32", attention="torch",
                 tensor_parallel_size=tp, progress=False) as llm:
            outs[tp] = llm.generate(["hello there friend", "a bias test of qkv"], params)
    assert [o.outputs[0].token_ids for o in outs[2]] == [o.outputs[0].token_ids for o in outs[1]]
    compared = 0
    for one, two in zip(outs[1], outs[2], strict=True):
        for a, b in zip(one.prompt_logprobs, two.prompt_logprobs, strict=True):
            if a is None:
                continue
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [lp for _, lp in b.top] == pytest.approx([lp for _, lp in a.top], abs=1e-4)
            compared += 1
    assert compared >= 30


def test_llm_tp2_greedy_matches_tp1(model_dir):
    """End to end through LLM: greedy text of --tp 2 equals --tp 1 over 48 tokens."""
    from lmkit.frontend.llm import LLM

    prompts = ["hello there", "a much longer prompt about tensors and ranks", "x"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        with LLM(str(model_dir), device="cpu", dtype="float32", attention="torch",
                 tensor_parallel_size=tp, progress=False) as llm:
            if tp == 2:
                assert llm.engine.stack.get("executor").name == "mp"
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs[2] == outs[1]
    assert all(len(ids) == 48 for ids in outs[1])


def test_embeddings_through_tp2_equal_tp1(model_dir):
    """Pooling requests cross the mp workers' step codec (pooling params in, pooled
    vectors out): mean and last embeddings of --tp 2 equal --tp 1."""
    from lmkit.api import PoolingParams
    from lmkit.frontend.llm import LLM

    prompts = ["hello there", "a much longer prompt about tensors and ranks"]
    outs = {}
    for tp in (1, 2):
        with LLM(str(model_dir), device="cpu", dtype="float32", attention="torch",
                 tensor_parallel_size=tp, progress=False) as llm:
            outs[tp] = [o.embedding for kind in ("mean", "last")
                        for o in llm.embed(prompts, PoolingParams(pooling_type=kind))]
    assert len(outs[2]) == 4 and len(outs[2][0]) == len(outs[1][0])
    for got, want in zip(outs[2], outs[1], strict=True):
        assert got == pytest.approx(want, abs=1e-4)


def _started_executor(host, model_dir, tp):
    from lmkit.api.contract import build
    from lmkit.config.schema import LMKitConfig
    from lmkit.loading.model_facts import load_model_facts
    from lmkit.plugin_host.resolve import resolve_stack

    config = LMKitConfig.model_validate({
        "model": {"model": str(model_dir), "dtype": "float32", "max_model_len": 64},
        "cache": {"block_size": 4, "num_blocks": 16}, "attention": {"backend": "torch"},
        "executor": {"device": "cpu"}, "parallel": {"tensor_parallel_size": tp}})
    stack = resolve_stack(config, host)
    # as the engine builds it (lmkit.api.contract.build: the checked constructor call)
    executor = build("executor", stack.get("executor").spec.load(), config, stack,
                     options=None, host=host, facts=load_model_facts(model_dir, host, 64))
    executor.start()
    executor.initialize_kv_cache(16)
    return config, executor


def test_killed_worker_fails_execute_within_5s(host, model_dir):
    from lmkit.api import Request
    from lmkit.scheduler.paged import PagedScheduler
    from lmkit_plugins.executors.mp import WorkerFailedError

    config, executor = _started_executor(host, model_dir, 2)
    try:
        sched = PagedScheduler(config, num_blocks=16)
        sched.add_request(Request("r", [1, 2, 3, 4, 5], SamplingParams(
            temperature=0.0, max_tokens=20, ignore_eos=True), arrival_time=0.0))
        so = sched.schedule()
        sched.update_from_output(so, executor.execute(so))  # a healthy step first
        victim = executor.procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"rank 1 .*killed by signal 9"):
            executor.execute(sched.schedule())
        assert time.monotonic() - began < 5.0
        assert all(p.poll() is not None for p in executor.procs)  # rank 0 was stopped too
        with pytest.raises(WorkerFailedError):  # and stays failed
            executor.offload_stats()
    finally:
        began = time.monotonic()
        executor.shutdown()
        executor.shutdown()
        assert time.monotonic() - began < 5.0


def test_worker_failure_during_load_is_reported(host, tmp_path, model_dir):
    import shutil

    from lmkit_plugins.executors.mp import WorkerFailedError

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    with pytest.raises(WorkerFailedError, match=r"worker rank \d failed: .*cannot read weights"):
        _started_executor(host, broken, 2)
