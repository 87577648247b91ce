"""``CausalLM.compute_greedy_logits``: the greedy steps the engine launches ahead take
their argmax over the LM head's own output (bfloat16 here), never converted to float32;
the argmax is the float32 logits' own, ties and all."""

from __future__ import annotations

import pytest
import torch
from lmkit.api import CausalLM, SamplingParams
from lmkit.sample.sampler import Sampler
from lmkit.testing.tiny_model import (
    load_tiny_model,
    make_tiny_deepseek,
    make_tiny_model,
    make_tiny_qwen3,
)
from lmkit.worker.input_batch import CachedRequestState
from lmkit.worker.lookahead_sampling import draw_ahead
from lmkit_plugins.attention.mla_torch import MLATorchAttention
from lmkit_plugins.attention.torch_ref import TorchAttention
from lmkit_plugins.models.deepseek import DeepseekV3ForCausalLM
from lmkit_plugins.models.gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM
from lmkit_plugins.models.llama import LlamaForCausalLM


def _llama(path):
    return load_tiny_model(make_tiny_model(path), LlamaForCausalLM, TorchAttention,
                           dtype=torch.bfloat16)


def _qwen3_tied(path):
    make_tiny_qwen3(path)
    model = load_tiny_model(path, LlamaForCausalLM, TorchAttention, dtype=torch.bfloat16)
    assert model.lm_head is None  # the head is the embedding table
    return model


def _deepseek(path):
    pytest.importorskip("transformers")
    return load_tiny_model(make_tiny_deepseek(path, 3), DeepseekV3ForCausalLM,
                           MLATorchAttention, dtype=torch.bfloat16)


@pytest.mark.parametrize("build", [_llama, _qwen3_tied, _deepseek],
                         ids=["llama", "qwen3-tied", "deepseek-v3"])
def test_greedy_logits_are_the_heads_output_and_keep_the_argmax(tmp_path, build):
    model = build(tmp_path)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, model.dims.hidden_size, generator=g).to(torch.bfloat16)
    hidden[0] = 0  # every logit equal: the first id wins on both sides
    with torch.inference_mode():
        exact = model.compute_logits(hidden)
        greedy = model.compute_greedy_logits(hidden)
    assert exact.dtype == torch.float32
    assert greedy.dtype == torch.bfloat16 and greedy.is_contiguous()
    assert torch.equal(greedy.float(), exact)  # the float32 logits convert it exactly
    assert torch.equal(greedy.argmax(-1), exact.argmax(-1))
    assert greedy[0].argmax().item() == 0


@pytest.mark.parametrize("cls", [Gemma3ForCausalLM, Gemma2ForCausalLM])
def test_soft_capped_logits_keep_the_float32_default(cls):
    """tanh soft-capping in bfloat16 could round distinct logits together, so these
    models keep ``compute_greedy_logits = compute_logits``."""
    assert cls.compute_greedy_logits is CausalLM.compute_greedy_logits


class _Heads:
    """A model whose two heads say which one a draw read."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.calls = logits, []

    def compute_logits(self, hidden):
        self.calls.append("float32")
        return self.logits.float()

    def compute_greedy_logits(self, hidden):
        self.calls.append("greedy")
        return self.logits


def _states(*params: SamplingParams) -> list[CachedRequestState]:
    return [CachedRequestState(f"r{i}", [1, 2], [], p, None, None, 2)
            for i, p in enumerate(params)]


@pytest.mark.parametrize("sampler", [None, Sampler()], ids=["no-sampler", "sampler"])
def test_a_greedy_launched_step_reads_the_greedy_logits(sampler):
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 5.0]], dtype=torch.bfloat16)
    model = _Heads(logits)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    tokens = draw_ahead(sampler, _states(greedy, greedy), ["r0", "r1"], model,
                        torch.zeros(2, 8), None)
    assert model.calls == ["greedy"]
    assert tokens.tolist() == [1, 0]


def test_a_sampled_launched_step_reads_the_float32_logits():
    logits = torch.full((2, 4), -30.0, dtype=torch.bfloat16)
    logits[:, 2] = 30.0  # every draw takes id 2
    model = _Heads(logits)
    states = _states(SamplingParams(temperature=0.0, max_tokens=4),
                     SamplingParams(temperature=1.0, seed=3, max_tokens=4))
    tokens = draw_ahead(Sampler(), states, ["r0", "r1"], model, torch.zeros(2, 8), None)
    assert model.calls == ["float32"]
    assert tokens.tolist() == [2, 2]
