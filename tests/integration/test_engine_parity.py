"""The engine against Hugging Face transformers, token for token (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from lmkit import LLM, SamplingParams
from lmkit.benchmarking.prompts import CHAT_PROMPTS

NUM_PROMPTS = 16
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smol_llm(smollm2_dir):
    llm = LLM(str(smollm2_dir), dtype="float32", max_num_seqs=64)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def chat_ids(llm: LLM, text: str) -> list[int]:
    _, ids = llm.input_processor.tokenize(None, [{"role": "user", "content": text}])
    return ids


def hf_greedy_mismatch(model, prompt_ids: list[int], got: list[int], n: int) -> str | None:
    """Why ``got`` is not ``hf_greedy(model, prompt_ids, n)``, or None when it is, from
    one forward pass over ``prompt_ids + got`` instead of ``n`` decode steps. HF's greedy
    continuation is the unique sequence whose every token is the argmax of the logits
    after the prompt and the tokens before it, ending at its first EOS or at ``n``
    tokens; ``got`` is checked for exactly that."""
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    if not 0 < len(got) <= n:
        return f"{len(got)} tokens, asked for {n}"
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids + got])
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
    # position len(prompt) - 1 + i predicts got[i]
    want = logits[len(prompt_ids) - 1:-1].argmax(dim=-1).tolist()
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            return f"token {i}: lmkit {g}, hf {w} after {got[:i]}"
        if g in stops and i < len(got) - 1:
            return f"token {i} is EOS ({g}), hf stops there; lmkit went on: {got[i + 1:]}"
    if len(got) < n and got[-1] not in stops:
        return f"lmkit stopped after {len(got)} tokens without EOS; hf goes on to {n}"
    return None


@pytest.mark.slow  # 16 prompts through lmkit batched, checked against HF one by one
def test_smollm2_batched_greedy_matches_hf_per_prompt(smol_llm, hf_model):
    prompts = [chat_ids(smol_llm, t) for t in CHAT_PROMPTS[:NUM_PROMPTS]]
    assert len({tuple(p) for p in prompts}) == NUM_PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = smol_llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        got = out.outputs[0].token_ids
        # HF's generate per prompt stops at EOS (in batches it pads after it)
        assert (why := hf_greedy_mismatch(hf_model, prompt, got, NEW_TOKENS)) is None, \
            f"prompt {prompt[:8]}...: {why}"
    # the check is HF's generate: the first prompt through it too
    assert outs[0].outputs[0].token_ids == hf_greedy(hf_model, prompts[0], NEW_TOKENS)


def _random_model_dir(tmp_path, smollm2_dir, config):
    """A random-weight HF model of the given config with SmolLM2's tokenizer files."""
    import shutil

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, tmp_path / name)
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "mixtral", "qwen2-hybrid", "gemma3",
                                  "gemma2"])
def test_random_model_batched_greedy_matches_hf(arch, tmp_path, smollm2_dir):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(vocab_size=49152, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    if arch == "qwen3":
        config = Qwen3Config(head_dim=32, tie_word_embeddings=False, **common)
    elif arch == "mistral":
        config = MistralConfig(sliding_window=None, **common)
    elif arch == "qwen2-hybrid":  # layer 0 full attention, layer 1 a 16-token window
        config = Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                             **common)
    elif arch == "gemma3":  # 16-token windows on 2 of 3 layers, a local RoPE base
        config = Gemma3TextConfig(head_dim=32, sliding_window=16, rope_local_base_freq=100.0,
                                  layer_types=["sliding_attention", "full_attention",
                                               "sliding_attention"],
                                  **{**common, "num_hidden_layers": 3})
    elif arch == "gemma2":  # alternating 16-token windows; attention scores soft-capped
        config = Gemma2Config(head_dim=32, sliding_window=16, attn_logit_softcapping=5.0,
                              **{**common, "num_hidden_layers": 3})
    else:  # sparse MoE MLPs, sliding-window attention
        config = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                               **common)
    hf = _random_model_dir(tmp_path, smollm2_dir, config)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 49000, (n,), generator=gen).tolist() for n in (5, 17, 33, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(tmp_path), dtype="float32", block_size=16) as llm:
        outs = llm.generate(prompts, params)
        if arch in ("qwen2-hybrid", "gemma3", "gemma2"):  # again, from the prefix cache: the
            # sliding group reads cached blocks, of which the window covers only the last
            again = llm.generate(prompts, params)
            assert llm.stats()["prefix_cache_hits"] >= 16 + 32 + 48
            assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids
                                                                for o in outs]
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_sliding_window_model_releases_blocks_behind_the_window(tmp_path, smollm2_dir):
    """Every layer slides over 16 tokens: blocks behind the window go back to the pool
    while requests run, so 4 requests that would need 18 blocks of 16 run in 13 without
    preemption, the freed blocks rewritten by others, and still match HF."""
    from transformers import MistralConfig

    config = MistralConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, sliding_window=16, eos_token_id=2,
                           bos_token_id=1)
    hf = _random_model_dir(tmp_path, smollm2_dir, config)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, 49000, (n,), generator=gen).tolist() for n in (17, 33, 48, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(tmp_path), dtype="float32", block_size=16, num_blocks=14, max_model_len=128,
             enable_prefix_caching=False) as llm:
        outs = llm.generate(prompts, params)
        assert llm.stats()["num_preemptions"] == 0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
