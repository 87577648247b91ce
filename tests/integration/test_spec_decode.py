"""Speculative decoding on SmolLM2 (CPU): greedy outputs are identical with and without
``--speculative ngram`` whatever the batch size, chunking, prefix caching or preemption; drafts
really are accepted; sampled requests with seeds, penalties and logprobs work."""

from __future__ import annotations

import pytest
from lmkit import LLM, SamplingParams
from lmkit.benchmarking.prompts import CHAT_PROMPTS
from lmkit.benchmarking.workload import copy_passages

pytestmark = pytest.mark.slow  # SmolLM2 engines with and without drafts, 4.5-8.5 s each

NEW_TOKENS = 32
SPEC = dict(speculative="ngram", num_speculative_tokens=4)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    """Copy-heavy prompts (drafts get accepted), open questions, and two prompts sharing
    a long prefix; with the plain engine's greedy outputs."""
    with LLM(str(smollm2_dir), dtype="float32") as llm:
        def chat(text):
            return llm.input_processor.tokenize(None, [{"role": "user", "content": text}])[1]

        passages = [" ".join(p.split()[:48]) for p in copy_passages()[:3]]
        ids = [chat(f"Repeat the following text exactly:\n\n{p}") for p in passages]
        ids.append(chat(CHAT_PROMPTS[0]))
        ids.append(ids[0] + chat(CHAT_PROMPTS[5]))  # shares ids[0] as a cached prefix
        baseline = [o.outputs[0].token_ids for o in llm.generate(ids, _greedy())]
    return ids, baseline


def _run(smollm2_dir, ids, params, **options):
    with LLM(str(smollm2_dir), dtype="float32", **options) as llm:
        outs = llm.generate(ids, params)
        return [o.outputs[0].token_ids for o in outs], llm.stats(), outs


CASES = {
    "batch-1": dict(max_num_seqs=1),
    "batch-all": dict(max_num_seqs=64),
    "chunks-16-no-prefix-cache-k2": dict(max_num_batched_tokens=16, enable_prefix_caching=False,
                                         num_speculative_tokens=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_outputs_identical_with_ngram(case, prompts, smollm2_dir):
    ids, baseline = prompts
    got, stats, _ = _run(smollm2_dir, ids, _greedy(), **{**SPEC, **CASES[case]})
    assert got == baseline
    assert stats["spec_num_accepted_tokens"] > 0
    assert stats["spec_mean_accepted_length"] > 1.5  # the copy prompts are copied


def test_prefix_cache_hits_and_preemption(prompts, smollm2_dir):
    ids, baseline = prompts
    block_size = 16
    longest = max(map(len, ids)) + NEW_TOKENS
    # room for the longest request plus a little: the others get preempted
    num_blocks = -(-longest // block_size) + 6
    got, stats, _ = _run(smollm2_dir, ids + ids[:2], _greedy(), block_size=block_size,
                         num_blocks=num_blocks, max_model_len=longest + 16, **SPEC)
    assert stats["num_preemptions"] > 0, "the KV pool was meant to force preemptions"
    assert stats["prefix_cache_hits"] > 0
    assert got == baseline + baseline[:2]


def test_stop_tokens_and_n_with_drafts(prompts, smollm2_dir):
    ids, baseline = prompts
    copy = ids[0]
    stop_at = baseline[0][10]  # a token the greedy copy emits, likely inside a draft
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            stop_token_ids=[stop_at], n=2)
    with LLM(str(smollm2_dir), dtype="float32", **SPEC) as llm:
        (out,) = llm.generate([copy], params)
    first = baseline[0].index(stop_at)
    for completion in out.outputs:
        assert completion.token_ids == baseline[0][:first + 1]
        assert completion.finish_reason == "stop"


def test_sampled_requests_are_reproducible_with_penalties_and_logprobs(prompts, smollm2_dir):
    ids, _ = prompts
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=NEW_TOKENS,
                             ignore_eos=True, repetition_penalty=1.1 if i % 2 else 1.0,
                             logprobs=2 if i < 2 else None) for i in range(3)]
    with LLM(str(smollm2_dir), dtype="float32", **SPEC) as llm:
        first = llm.generate(ids[:3], params)
        again = llm.generate(ids[:3], params)  # the same seeds, a warm prefix cache
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert stats["spec_num_accepted_tokens"] > 0
    for out in first[:2]:
        c = out.outputs[0]
        assert len(c.token_ids) == NEW_TOKENS and len(c.logprobs) == NEW_TOKENS
        assert all(lp.token_id == t for lp, t in zip(c.logprobs, c.token_ids, strict=True))
