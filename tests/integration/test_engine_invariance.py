"""Greedy outputs do not depend on how the engine batches, chunks, caches or preempts."""

from __future__ import annotations

import pytest
from lmkit import LLM, SamplingParams
from lmkit.benchmarking.prompts import CHAT_PROMPTS

pytestmark = pytest.mark.slow  # SmolLM2 engines per case, 3.5-12 s each

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    with LLM(str(smollm2_dir), dtype="float32") as llm:
        ids = [llm.input_processor.tokenize(None, [{"role": "user", "content": t}])[1]
               for t in CHAT_PROMPTS[:8]]
        # two prompts sharing a long prefix exercise the prefix cache
        ids.append(ids[0] + ids[1])
        ids.append(ids[0] + ids[2])
        baseline = [o.outputs[0].token_ids for o in llm.generate(ids, _params())]
    return ids, baseline


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


CASES = {
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunk-16": dict(max_num_batched_tokens=16),
    "chunk-64": dict(max_num_batched_tokens=64),
    "chunk-4096": dict(max_num_batched_tokens=4096),
    "seqs-1": dict(max_num_seqs=1),
    "seqs-4": dict(max_num_seqs=4),
    "seqs-64": dict(max_num_seqs=64),
    "priority-scheduler": dict(scheduler="priority", max_num_seqs=4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_outputs_identical(case, prompts, smollm2_dir):
    ids, baseline = prompts
    with LLM(str(smollm2_dir), dtype="float32", **CASES[case]) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(ids, _params())]
    assert got == baseline


def test_greedy_outputs_identical_under_preemption(prompts, smollm2_dir):
    ids, baseline = prompts
    longest = max(map(len, ids)) + NEW_TOKENS
    block_size = 16
    # room for one longest request plus a little: the rest must be preempted
    num_blocks = -(-longest // block_size) + 5
    with LLM(str(smollm2_dir), dtype="float32", block_size=block_size, num_blocks=num_blocks,
             max_model_len=longest + 16) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(ids, _params())]
        preemptions = llm.stats()["num_preemptions"]
    assert preemptions > 0, "the KV pool was meant to be small enough to force preemptions"
    assert got == baseline
