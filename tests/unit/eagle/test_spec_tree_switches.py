"""Draft trees beside speculation's switches: off above a batch size (the head catching
up on the requests that ran plainly, or dropping them) and adaptive speculation
(drafting only while drafts measure faster). Greedy outputs stay identical to plain
decoding, and whole trees are drafted in the steps that speculate."""

from __future__ import annotations

import pytest
from eagle_engine import COMMON, GREEDY, PROMPTS, tokens
from lmkit import LLM

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]]


def tree_llm(heads, tiny, **settings):
    return LLM(str(tiny), speculative="eagle3", speculative_model=str(heads["eagle3"]),
               speculative_tree=TREE, max_num_seqs=8, num_blocks=96,
               **{**COMMON, "max_model_len": 64, **settings})


@pytest.mark.parametrize("catch_up", [True, False], ids=["catch-up", "no-catch-up"])
def test_trees_off_above_a_batch_size(tiny, heads, baseline, catch_up):
    with tree_llm(heads, tiny, **{"speculative.disable_by_batch_size": 2,
                                  "speculative.catch_up_when_off": catch_up}) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline  # 5 at once: plainly
        batched = llm.stats()["spec_num_draft_tokens"]
        for i in (0, 1):  # one at a time: trees
            assert tokens(llm.generate([PROMPTS[i]], GREEDY)) == [baseline[i]]
        alone = llm.stats()["spec_num_draft_tokens"] - batched
    assert alone >= len(TREE) * 5 and batched < alone


def test_adaptive_speculation_probes_trees(tiny, heads, baseline):
    """Adaptive speculation times tree steps against plain ones (its probe drafts whole
    trees) and keeps whichever measured faster; the outputs never change."""
    with tree_llm(heads, tiny, **{"speculative.adaptive": True}) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        for i in (0, 1):
            assert tokens(llm.generate([PROMPTS[i]], GREEDY)) == [baseline[i]]
        stats = llm.stats()
    assert stats["spec_adaptive_probes"] >= 1 and stats["spec_num_draft_tokens"] >= len(TREE) * 5
    assert stats["spec_adaptive_tokens_per_s_spec"] > 0
    assert stats["spec_adaptive_tokens_per_s_plain"] > 0
