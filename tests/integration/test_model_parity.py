"""lmkit's Llama-family models (and Mixtral, DeepSeek-V2/V3 on mla_torch) through the ModelRunner against HF transformers (float32).

Tiny random-weight models of each supported variant are built with transformers and
saved as safetensors; the runner is driven with hand-built SchedulerOutputs. Logits
must match HF's at every position (teacher forcing on the generated sequence) and
greedy tokens must equal HF's ``generate`` per prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lmkit.api.sampling_params import SamplingParams
from lmkit.api.scheduler_output import NewRequestData, SchedulerOutput
from lmkit.config.schema import LMKitConfig
from lmkit.loading.model_facts import load_model_facts
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import resolve_stack
from lmkit.worker.model_runner import ModelRunner

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)

DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=24, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32,
            beta_slow=1)

VARIANTS = {
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama-linear-tied": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                              tie_word_embeddings=True, num_key_value_heads=1)),
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    # hybrid: layer 0 full attention, layer 1 a 6-token window (two KV cache groups)
    "qwen2-hybrid": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=6,
                                         max_window_layers=1)),
    "qwen3-hybrid": ("Qwen3Config", dict(head_dim=32, use_sliding_window=True,
                                         sliding_window=6, max_window_layers=1,
                                         num_hidden_layers=3)),
    # Gemma-3 text: layers 0, 1 slide (6 tokens, local RoPE base), layer 2 is global
    # (linear RoPE scaling on global layers only, as Gemma-3 4B+ checkpoints have)
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, sliding_window=6, num_hidden_layers=3,
                                        layer_types=["sliding_attention", "sliding_attention",
                                                     "full_attention"],
                                        query_pre_attn_scalar=24, rope_local_base_freq=100.0,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0},
                                        final_logit_softcapping=30.0)),
    # Gemma-2: layers 0, 2 slide (6 tokens), layer 1 is global; attention scores capped
    # at 1 and logits at 3 (low enough to bite on these random weights)
    "gemma2": ("Gemma2Config", dict(head_dim=32, sliding_window=6, num_hidden_layers=3,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
                                    final_logit_softcapping=3.0)),
    # sparse MoE MLPs (4 experts, top-2) on Mistral-style sliding-window attention
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=8)),
    # MLA + MoE (first layer dense, shared expert); V2 without q-LoRA, greedy routing
    "deepseek-v2": ("DeepseekV2Config", dict(DEEPSEEK, q_lora_rank=None)),
    # V2 with q-LoRA, group-limited routing and YaRN (attention_factor != 1)
    "deepseek-v2-qlora-yarn": ("DeepseekV2Config", dict(
        DEEPSEEK, q_lora_rank=48, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=0.5))),
    # V3: sigmoid bias-corrected grouped routing, interleaved RoPE pairs, YaRN
    "deepseek-v3": ("DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=48, n_group=2, topk_group=1,
                                             rope_scaling=dict(YARN, mscale=0.7,
                                                               mscale_all_dim=0.7))),
    "deepseek-v3-halves": ("DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=None, n_group=2,
                                                    topk_group=1, rope_interleave=False)),
}
#: variants served by an MLA attention backend (the rest by torch)
ATTENTION = {name: "mla_torch" for name in VARIANTS if name.startswith("deepseek")}


def build_hf_model(variant: str, directory: Path):
    import transformers

    cls_name, extra = VARIANTS[variant]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norm weights start at 0 (Gemma) or 1: make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory)
    return model


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model = build_hf_model(request.param, directory)
    return request.param, model, directory


def make_runner(model_dir: Path, block_size: int = 16, device: str = "cpu",
                attention: str = "torch") -> ModelRunner:
    config = LMKitConfig.model_validate({
        "model": {"model": str(model_dir), "dtype": "float32"},
        "cache": {"block_size": block_size},
        "attention": {"backend": attention},
        "executor": {"device": device},
    })
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    runner = ModelRunner(config, resolve_stack(config, host), host, load_model_facts(model_dir, host))
    runner.load_model()
    runner.initialize_kv_cache(128)
    return runner


class Driver:
    """A minimal scheduler: hands the runner explicit chunks and records hidden states."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.block_size = runner.block_size
        self.next_block = 0
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.logits: dict[str, dict[int, torch.Tensor]] = {}  # rid -> position -> logits
        self._hidden: list[torch.Tensor] = []
        model = runner.model
        forward = model.forward

        def spy(*args, **kwargs):
            hidden = forward(*args, **kwargs)
            self._hidden.append(hidden.clone())
            return hidden

        model.forward = spy

    def _new_blocks(self, rid: str, upto: int) -> list[int]:
        need = -(-upto // self.block_size) - len(self.blocks[rid])
        new = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += len(new)
        self.blocks[rid] += new
        return new

    def step(self, work: dict[str, int], prompts: dict[str, list[int]] | None = None,
             params: SamplingParams | None = None):
        params = params or SamplingParams(temperature=0.0, max_tokens=100)
        so = SchedulerOutput()
        for rid, n in work.items():
            if rid in (prompts or {}):
                self.tokens[rid], self.computed[rid], self.blocks[rid] = list(prompts[rid]), 0, []
                self.logits[rid] = {}
                self._new_blocks(rid, n)
                so.scheduled_new_reqs.append(NewRequestData(
                    rid, list(prompts[rid]), [], params, list(self.blocks[rid]), 0))
            else:
                so.scheduled_cached_reqs.req_ids.append(rid)
                so.scheduled_cached_reqs.new_block_ids.append(
                    self._new_blocks(rid, self.computed[rid] + n))
                so.scheduled_cached_reqs.num_computed_tokens.append(self.computed[rid])
            so.num_scheduled_tokens[rid] = n
        so.total_num_scheduled_tokens = sum(work.values())
        out = self.runner.execute_model(so)
        hidden = self._hidden.pop()
        start = 0
        with torch.inference_mode():
            for rid in out.req_ids:
                n = work[rid]
                logits = self.runner.model.compute_logits(hidden[start:start + n])
                for j in range(n):
                    self.logits[rid][self.computed[rid] + j] = logits[j]
                start += n
        for rid, sampled in zip(out.req_ids, out.sampled_token_ids, strict=True):
            self.computed[rid] += work[rid]
            self.tokens[rid] += sampled
        return out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


PROMPTS = {"a": [3, 17, 9, 250, 41], "b": list(range(100, 117)),
           "c": [(i * 37 + 11) % VOCAB for i in range(33)]}
NEW_TOKENS = 10


def check_against_hf(model, driver: Driver):
    for rid, prompt in PROMPTS.items():
        tokens = driver.tokens[rid]
        assert tokens[len(prompt):] == hf_greedy(model, prompt, NEW_TOKENS), rid
        expected = hf_logits(model, tokens[:-1])
        got = torch.stack([driver.logits[rid][p] for p in range(len(tokens) - 1)])
        torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=1e-4)


def test_batched_prefill_then_decodes_match_hf(variant, device):
    name, model, directory = variant
    driver = Driver(make_runner(directory, block_size=16, device=device,
                                attention=ATTENTION.get(name, "torch")))
    out = driver.step({rid: len(p) for rid, p in PROMPTS.items()}, PROMPTS)
    assert all(len(s) == 1 for s in out.sampled_token_ids)
    for _ in range(NEW_TOKENS - 1):
        driver.step({rid: 1 for rid in PROMPTS})
    check_against_hf(model, driver)


def test_chunked_prefill_mixed_with_decodes_matches_hf(variant, device):
    name, model, directory = variant
    driver = Driver(make_runner(directory, block_size=4, device=device,
                                attention=ATTENTION.get(name, "torch")))
    # "c" (33 tokens) is prefilled in chunks of 7, 13 and 13 while "a" and "b" decode
    out = driver.step({"a": 5, "c": 7}, {"a": PROMPTS["a"], "c": PROMPTS["c"]})
    assert out.sampled_token_ids[out.req_ids.index("c")] == []
    driver.step({"a": 1, "c": 13, "b": 17}, {"b": PROMPTS["b"]})
    out = driver.step({"c": 13, "a": 1, "b": 1})
    assert len(out.sampled_token_ids[out.req_ids.index("c")]) == 1
    while any(len(driver.tokens[r]) < len(p) + NEW_TOKENS for r, p in PROMPTS.items()):
        driver.step({r: 1 for r, p in PROMPTS.items()
                     if len(driver.tokens[r]) < len(p) + NEW_TOKENS})
    check_against_hf(model, driver)


def test_hybrid_model_plans_each_groups_backend_once_per_step(tmp_path):
    build_hf_model("qwen3-hybrid", tmp_path)
    runner = make_runner(tmp_path)
    groups = runner.kv_groups
    assert [g.spec.describe() for g in groups] == ["full_attention",
                                                   "sliding_window(window=6)"]
    assert [g.layers for g in groups] == [(0,), (1, 2)]
    assert runner.model.attn is groups[0].attn and groups[1].attn.sliding_window == 6
    calls = []
    for g in groups:
        plan = g.attn.plan
        g.attn.plan = lambda md, plan=plan, g=g: (calls.append(g.spec.kind), plan(md))[1]
    driver = Driver(runner)
    driver.step({"a": 5}, {"a": PROMPTS["a"]})
    driver.step({"a": 1})
    assert calls == ["full_attention", "sliding_window"] * 2
