"""The engine samples with the chosen sampling kernels: a test plugin's kernels (always
token 7 for random rows) reach the model runner through ``--sampling-kernels`` and
``auto`` (by priority on the CPU), greedy requests never use them, and ``none`` keeps
the core's torch kernels (seeded outputs identical to ``torch``)."""

from __future__ import annotations

import pytest
import torch
from lmkit import LLM, SamplingParams
from lmkit.api import Caps, Spec, TorchSamplingKernels, hookimpl
from lmkit.testing.tiny_model import make_tiny_model

LMKIT_PLUGIN_API = ">=1.0,<2"  # this module is loaded as a plugin (-p)
SEVEN = 7


class AlwaysSeven(TorchSamplingKernels):
    """Every random row draws token 7 (seeded rows: the torch path, as the contract asks)."""

    def sample(self, logits, rows):
        if rows.generators:
            return super().sample(logits, rows)
        return torch.full((logits.shape[0],), SEVEN, dtype=torch.int64, device=logits.device)


@hookimpl
def register_sampling_kernels(register):
    register(Spec(name="seven", target=lambda: AlwaysSeven, priority=5,
                  caps=Caps(values={"device": {"cpu"}})))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-kernels"))


COMMON = dict(device="cpu", dtype="float32", max_model_len=128, num_blocks=64, block_size=4)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _tokens(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(["abcabc", "xyz"], params)]


@pytest.mark.parametrize("choice", ["seven", "auto"])
def test_the_chosen_kernels_draw_the_random_rows(tiny, choice):
    with LLM(str(tiny), sampling_kernels=choice, plugins=[__name__], **COMMON) as llm:
        assert _tokens(llm, SAMPLED) == [[SEVEN] * 6] * 2
        greedy = _tokens(llm, GREEDY)
    with LLM(str(tiny), sampling_kernels="torch", **COMMON) as llm:
        assert _tokens(llm, GREEDY) == greedy  # greedy rows keep the sampler's argmax


def test_none_is_the_core_torch_path(tiny):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True, seed=3)
    with LLM(str(tiny), sampling_kernels="none", **COMMON) as llm:
        base = _tokens(llm, seeded)
    with LLM(str(tiny), sampling_kernels="torch", **COMMON) as llm:
        assert _tokens(llm, seeded) == base
    with LLM(str(tiny), sampling_kernels="seven", plugins=[__name__], **COMMON) as llm:
        assert _tokens(llm, seeded) == base  # seeded rows: the plugin hands them back
