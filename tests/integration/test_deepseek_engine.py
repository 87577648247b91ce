"""DeepSeek-V2/V3 (MLA on mla_torch, MoE) through the engine on the CPU: greedy outputs
equal transformers', and prefix caching, KV offload (CPU tier) and preemption work on
the latent cache with outputs unchanged; mismatched attention backends are refused
before any weight loads."""

from __future__ import annotations

import pytest
from deepseek_reference import hf_greedy, tiny_deepseek_and_hf, tokens
from lmkit import LLM, SamplingParams
from lmkit.errors import NoBackendError
from lmkit.testing.tiny_model import make_tiny_deepseek, make_tiny_model

BLOCK = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def deepseek(request, tmp_path_factory):
    """``(directory, HF model)`` of a tiny DeepSeek-V2 (no q-LoRA) or V3 (q-LoRA, YaRN)."""
    return tiny_deepseek_and_hf(tmp_path_factory, request.param)


def test_batched_greedy_matches_hf(deepseek):
    directory, hf = deepseek
    prompts = [tokens(i, n) for i, n in enumerate((5, 17, 33, 64))]
    with LLM(str(directory), dtype="float32", block_size=BLOCK) as llm:
        assert llm.engine.stack.get("attention").name == "mla_torch"  # auto picks an MLA backend
        outs = llm.generate(prompts, PARAMS)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, PARAMS.max_tokens)


def test_prefix_cache_hits_on_the_latent_cache(deepseek):
    directory, hf = deepseek
    prefix = tokens(7, 3 * BLOCK + 5)
    a, b = prefix + [1, 2, 3], prefix + [9, 8, 7, 6]
    with LLM(str(directory), dtype="float32", block_size=BLOCK) as llm:
        first = llm.generate([a], PARAMS)[0]
        second = llm.generate([b], PARAMS)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 3 * BLOCK
    assert second.outputs[0].token_ids == hf_greedy(hf, b, PARAMS.max_tokens)


def test_preemption_keeps_outputs(deepseek):
    directory, hf = deepseek
    prompts = [tokens(20 + i, 40 + 7 * i) for i in range(6)]
    # room for about two requests at a time: the others are preempted and resumed
    with LLM(str(directory), dtype="float32", block_size=BLOCK, num_blocks=12,
             max_model_len=128) as llm:
        outs = llm.generate(prompts, PARAMS)
        preemptions = llm.stats()["num_preemptions"]
    assert preemptions > 0, "the KV pool was meant to be small enough to force preemptions"
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, PARAMS.max_tokens)


def test_cpu_offload_restores_latent_blocks(deepseek):
    directory, hf = deepseek
    p1, p2, p3 = (tokens(s, 15 * BLOCK) for s in (31, 32, 33))
    # p1, then two prefixes that push it out of the device pool, then p1 again
    prompts = [p1 + [1, 2], p2 + [3], p3 + [4], p1 + [5, 6, 7]]
    engine = dict(dtype="float32", block_size=BLOCK, num_blocks=20, max_model_len=256)
    with LLM(str(directory), offload="cpu", **engine,
             **{"offload.options": {"size_gb": 0.01}}) as llm:
        outs = [llm.generate([p], PARAMS)[0] for p in prompts]
        stats = llm.stats()
    assert stats["offload_stored_blocks"] > 0
    assert stats["offload_loaded_blocks"] >= 14, stats
    assert stats["offload_failed_loads"] == 0
    assert outs[3].num_cached_tokens >= 14 * BLOCK
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, PARAMS.max_tokens)


def test_mismatched_attention_backends_are_refused_before_loading(tmp_path, monkeypatch):
    """A DeepSeek model on an MHA backend, a Llama model on an MLA one: refused at stack
    resolution, before any model is built or weight loads."""
    from lmkit_plugins.models.deepseek import DeepseekV2ForCausalLM
    from lmkit_plugins.models.llama import LlamaForCausalLM

    deepseek = make_tiny_deepseek(tmp_path / "ds", 2)
    llama = make_tiny_model(tmp_path / "llama")

    def built(*args, **kwargs):
        raise AssertionError("the model was built: the refusal came too late")

    for cls in (DeepseekV2ForCausalLM, LlamaForCausalLM):
        monkeypatch.setattr(cls, "__init__", built)
    with pytest.raises(NoBackendError, match="attention_kind mla not supported.*mla_torch"):
        LLM(str(deepseek), attention="torch")
    with pytest.raises(NoBackendError, match="attention_kind mha not supported"):
        LLM(str(llama), attention="mla_torch")
