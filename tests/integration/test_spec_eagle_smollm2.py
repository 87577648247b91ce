"""EAGLE heads on SmolLM2 (CPU, float32; random heads shaped for it): greedy outputs are
identical with and without ``--speculative eagle`` / ``eagle3`` whatever the batch size,
prefix caching or preemption, and every draft the paged EAGLE-3 head makes equals the
head computed densely over transformers' features of the real model."""

from __future__ import annotations

import pytest
from dense_eagle import DenseEagle
from lmkit import LLM, SamplingParams
from lmkit.benchmarking.prompts import CHAT_PROMPTS
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head

pytestmark = pytest.mark.slow  # SmolLM2 engines, 5-10 s each

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def heads(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-heads")
    return {"eagle": make_tiny_eagle_head(root / "eagle", smollm2_dir, layer_std=0.05),
            "eagle3": make_tiny_eagle3_head(root / "eagle3", smollm2_dir, layer_ids=(2, 15, 27),
                                            draft_vocab_size=4096, layer_std=0.05)}


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    """Chat prompts, one of them twice (a prefix-cache hit), with plain greedy outputs."""
    with LLM(str(smollm2_dir), dtype="float32") as llm:
        ids = [llm.input_processor.tokenize(None, [{"role": "user", "content": p}])[1]
               for p in CHAT_PROMPTS[:4]]
        ids.append(ids[0])
        baseline = [o.outputs[0].token_ids for o in llm.generate(ids, GREEDY)]
    return ids, baseline


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize("options", [
    dict(max_num_seqs=1),
    dict(max_num_seqs=8, max_num_batched_tokens=32, num_blocks=10, block_size=16,
         max_model_len=128),  # chunked prefill and preemptions
], ids=["batch-1", "chunked-preempted"])
def test_greedy_outputs_identical(smollm2_dir, heads, prompts, proposer, options):
    ids, baseline = prompts
    with LLM(str(smollm2_dir), dtype="float32", speculative=proposer,
             speculative_model=str(heads[proposer]), num_speculative_tokens=3,
             **options) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(ids, GREEDY)]
        stats = llm.stats()
    assert got == baseline
    assert stats["spec_num_draft_tokens"] > 0
    if "num_blocks" in options:
        assert stats["num_preemptions"] > 0


def test_eagle3_drafts_equal_the_dense_head(smollm2_dir, heads, prompts, monkeypatch):
    from lmkit.spec_decode.manager import ProposerManager

    seen = {}
    take = ProposerManager.take_runner_drafts

    def record(self, requests, drafts):
        for r in requests:
            if r.request_id in drafts:
                seen[tuple(r.all_token_ids)] = list(drafts[r.request_id])
        return take(self, requests, drafts)

    monkeypatch.setattr(ProposerManager, "take_runner_drafts", record)
    ids, _ = prompts
    with LLM(str(smollm2_dir), dtype="float32", speculative="eagle3",
             speculative_model=str(heads["eagle3"]), num_speculative_tokens=3,
             max_num_seqs=8, max_num_batched_tokens=32) as llm:
        llm.generate(ids[:3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(seen) >= 10
    reference = DenseEagle(smollm2_dir, heads["eagle3"])
    wrong = [(d, reference.drafts(list(k), len(d))) for k, d in list(seen.items())[:12]]
    wrong = [pair for pair in wrong if pair[0] != pair[1]]
    assert not wrong, wrong[:3]
