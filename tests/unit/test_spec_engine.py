"""Speculative decoding through the whole engine on the tiny random model: a proposer
that gives draft distributions (the rejection-sampling path end to end), the ngram
proposer's end-to-end conformance, and a proposer that opts requests out."""

from __future__ import annotations

import pytest
import torch
from lmkit import LLM, SamplingParams
from lmkit.api import Needs, Proposal, Spec, SpecProposer, hookimpl
from lmkit.plugin_host.manager import PluginHost
from lmkit.testing.spec_decode import check_spec_proposer
from lmkit.testing.tiny_model import make_tiny_model

LMKIT_PLUGIN_API = ">=1.0,<2"  # this module is loaded as a plugin (-p)
DRAFT_VOCAB = 256  # a prefix of the model's 320 ids: the core pads the distributions


class NoisyDrafts(SpecProposer):
    """Samples drafts from a random distribution seeded by the history (deterministic),
    and says so with ``draft_probs``."""

    def __init__(self, config, options=None):
        pass

    def propose(self, batch):
        drafts, probs = [], []
        for tokens in batch.token_ids:
            g = torch.Generator().manual_seed(len(tokens) * 1000 + int(tokens[-1]))
            q = torch.softmax(torch.randn(batch.num_spec_tokens, DRAFT_VOCAB, generator=g) * 3,
                              dim=-1)
            drafts.append(torch.multinomial(q, 1, generator=g).squeeze(1).tolist())
            probs.append(q)
        return Proposal(drafts, probs)


@hookimpl
def register_spec_proposers(register):
    register(Spec(name="noisy", target=lambda: NoisyDrafts,
                  stack_needs={"attention": Needs({"multi_token_query"})}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-spec"))


COMMON = dict(device="cpu", dtype="float32", max_model_len=256, num_blocks=96, block_size=4)
PROMPTS = ["abcabcabcabc", "the cat sat on the mat; the cat", "x", "0123401234"]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_draft_distributions_end_to_end(tiny):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = _tokens(LLM(str(tiny), **COMMON).generate(PROMPTS, greedy))
    llm = LLM(str(tiny), speculative="noisy", num_speculative_tokens=3,
              plugins=[__name__], **COMMON)
    assert _tokens(llm.generate(PROMPTS, greedy)) == base
    sampled = [SamplingParams(temperature=1.5, seed=i, max_tokens=24, ignore_eos=True)
               for i in range(len(PROMPTS))]
    first = _tokens(llm.generate(PROMPTS, sampled))
    assert _tokens(llm.generate(PROMPTS[::-1], sampled[::-1]))[::-1] == first
    stats = llm.stats()
    # a flat target and a peaked draft: some drafts pass rejection sampling
    assert stats["spec_num_verifications"] > 0 and stats["spec_num_accepted_tokens"] > 0


def test_requests_can_opt_out(tiny):
    llm = LLM(str(tiny), speculative="ngram", num_speculative_tokens=3, **COMMON)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            use_spec_decode=False)
    llm.generate(PROMPTS, params)
    assert llm.stats()["spec_num_proposed_tokens"] == 0
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert llm.stats()["spec_num_proposed_tokens"] > 0


def test_ngram_end_to_end_conformance(tiny):
    reg = PluginHost.load(env={}).registry.get("speculative", "ngram")
    assert check_spec_proposer(reg, model_dir=tiny, only=["end to end"]) == {
        "end to end": "passed"}
