"""``speculative.tree``: EAGLE / EAGLE-3 heads drafting token trees, verified in one
target pass with tree attention. Greedy outputs identical to plain decoding across
batching, prefix caching, chunked prefill and preemption; the drafted trees equal a
dense reference of the head; an oracle tree whose right answer sits off the first
branch (so accepted nodes move to a chain's slots) still decodes exactly, and accepts
several tokens per step; logprobs through accepted trees as plain decoding gives them;
sampled and penalised requests beside trees; the graph runners' padded replays; and the
refusals."""

from __future__ import annotations

import pytest
import tree_oracle
from dense_eagle import DenseEagle
from eagle_engine import (
    BATCHINGS,
    COMMON,
    GREEDY,
    PROMPTS,
    padded_replays,
    regex_case,
    run_engine,
    tokens,
)
from lmkit import LLM, SamplingParams
from lmkit.errors import ConfigError
from lmkit.spec_decode.tree import DraftTree

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]]


def tree_llm(tiny, head, proposer="eagle", tree=TREE, **settings):
    return LLM(str(tiny), speculative=proposer, speculative_model=str(head),
               speculative_tree=tree, **{**COMMON, "max_model_len": 64, **settings})


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize(("max_num_seqs", "num_blocks", "chunk"), BATCHINGS)
def test_greedy_outputs_identical_with_a_tree(tiny, heads, baseline, proposer, max_num_seqs,
                                              num_blocks, chunk):
    with tree_llm(tiny, heads[proposer], proposer, num_blocks=num_blocks,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        stats = llm.stats()
    if num_blocks < 96:
        assert stats["num_preemptions"] > 0
    assert stats["spec_num_verifications"] > 0
    assert stats["spec_num_draft_tokens"] > len(TREE) * 10  # whole trees were verified


@pytest.mark.parametrize("replays", [False, True], ids=["eager", "padded-replays"])
@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_tree_drafts_equal_a_dense_reference(tiny, heads, monkeypatch, proposer, replays):
    """Every tree the paged head drafted (level passes with tree attention over its own
    KV cache; eagerly, or through the graph runners' padded replays: a decode row per
    node) equals the head run densely along each node's path (a node whose logit ties
    the dense head's for its rank within 1e-4 counts as equal: the two order float32
    near-ties differently; the root of one tree here has ranks 2 and 3 6.7e-6 apart)."""
    if replays:
        padded_replays(monkeypatch)
    got, stats = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                            max_num_seqs=8, max_num_batched_tokens=16, num_blocks=20,
                            tree=TREE, k=len(TREE))
    assert stats["num_preemptions"] > 0 and len(got) > 20
    tree = DraftTree.from_paths(TREE)
    reference = DenseEagle(tiny, heads[proposer])
    wrong = {key: (drafts, reference.tree_drafts(list(key[1]), tree, len(drafts)))
             for key, drafts in got.items()
             if reference.tree_mismatches(list(key[1]), tree, drafts)}
    assert not wrong, f"{len(wrong)} of {len(got)} trees differ, e.g. {next(iter(wrong.values()))}"


def plant_truth(monkeypatch, baseline, prompts=PROMPTS, tree_paths=TREE,
                path=(1, 0, 0)) -> list[int]:
    """Make the head's trees (``tree_paths``) carry the true continuation (``baseline``:
    the plain outputs of ``prompts``) on the nodes of rank path ``path`` and its
    prefixes, by default (1,), (1, 0), (1, 0, 0), off the first branch; returns, per
    verified step, how many accepted nodes moved to a chain's slots."""
    truth = [list(p.encode()) + out for p, out in zip(prompts, baseline, strict=True)]
    return tree_oracle.plant(truth, tree_paths, path, monkeypatch.setattr)


def test_an_oracle_tree_off_the_first_branch_decodes_exactly(tiny, head, baseline,
                                                             monkeypatch):
    """Every step accepts nodes 2, 6, 8 of the tree (the planted truth), whose K/V and
    hidden rows move to a chain's slots before the head catches up; outputs stay those
    of plain decoding."""
    moved = plant_truth(monkeypatch, baseline)
    with tree_llm(tiny, head, num_blocks=96, max_num_seqs=8) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        stats = llm.stats()
    assert sum(moved) > 50  # accepted nodes off the first branch were moved
    assert stats["spec_mean_accepted_length"] > 3.0  # up to 3 drafts + 1 per step


def test_logprobs_through_accepted_trees_match_plain_decoding(tiny, head, baseline,
                                                              monkeypatch):
    """A greedy request asking for logprobs drafts trees too: each emitted token's
    logprobs (and top alternatives) come from the row that emitted it, the root's or an
    accepted node's, as plain decoding gives them."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3)
    with LLM(str(tiny), num_blocks=96, **{**COMMON, "max_model_len": 64}) as llm:
        plain = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    plant_truth(monkeypatch, baseline)  # deep accepted paths off the first branch
    with tree_llm(tiny, head, num_blocks=96, max_num_seqs=8) as llm:
        treed = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        assert llm.stats()["spec_mean_accepted_length"] > 3.0
    for a, b in zip(plain, treed, strict=True):
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert (x.token_id, x.rank) == (y.token_id, y.rank)
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.parametrize("planted", [False, True], ids=["head", "planted-truth"])
def test_constrained_requests_draft_trees_masked_along_each_path(tiny, head, monkeypatch,
                                                                 planted):
    """A grammar's mask rows follow each node's path (a node off the grammar is never
    accepted: its parent's row forbids it); nothing is trimmed; constrained outputs stay
    those decoded without speculation, through deep accepted trees too."""
    pytest.importorskip("xgrammar")
    prompts, params, base = regex_case(tiny)
    if planted:
        plant_truth(monkeypatch, base, prompts)
    with tree_llm(tiny, head, structured_output="auto", num_blocks=96) as llm:
        assert tokens(llm.generate(prompts, params)) == base
        stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["grammar_drafts_trimmed"] == 0
    if planted:
        assert stats["spec_mean_accepted_length"] > 2.5


def test_sampled_logprob_and_penalised_requests_beside_trees(tiny, head):
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.3,
                             presence_penalty=0.5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, n=3, max_tokens=12, ignore_eos=True)]
    with tree_llm(tiny, head, num_blocks=96, max_num_seqs=8) as llm:
        outs = llm.generate(PROMPTS[:4], params)
        again = llm.generate(PROMPTS[:1], params[:1])
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [12] * 6
    assert len(outs[1].outputs[0].logprobs) == 12
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids  # seeded


def test_trees_are_refused_without_a_draft_head_or_under_tensor_parallelism(tiny, head):
    with pytest.raises(ConfigError, match="proposer 'ngram' drafts from token ids"):
        LLM(str(tiny), speculative="ngram", speculative_tree=TREE, num_blocks=96, **COMMON)
    with pytest.raises(ConfigError, match="speculation is off"):
        LLM(str(tiny), speculative_tree=TREE, num_blocks=96, **COMMON)
    with pytest.raises(ConfigError, match="num_speculative_tokens is 3 but the tree has 8"):
        LLM(str(tiny), speculative="eagle", speculative_model=str(head),
            speculative_tree=TREE, num_speculative_tokens=3, num_blocks=96, **COMMON)


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_tree_verifications_replay_the_decode_graphs_flattened(tiny, heads, baseline,
                                                               monkeypatch, proposer):
    """Through the graph runners' padded, fixed-buffer forwards on the CPU (a tree's path
    on CUDA unless ``LMKIT_TREE_GRAPHS=0``): each node a decode row seeing its ancestors by its tree
    region and mask bits, its ``seq_len`` one past its slot's index; the head catches
    up through its catch-up graphs."""
    made, drafters = padded_replays(monkeypatch)
    moved = plant_truth(monkeypatch, baseline)  # deep paths: every node's row matters
    with tree_llm(tiny, heads[proposer], proposer, num_blocks=96, max_num_seqs=8) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        assert llm.stats()["spec_mean_accepted_length"] > 3.0
    assert made[0].tree and made[0].num_flattened_replays >= 5 and sum(moved) > 20
    # the head's catch-up after a (compacted) tree step replays its graphs, and so do
    # its level passes (flattened, with tree buffers, every level of a step in one replay)
    drafter = drafters[0]
    assert drafter.catch_up_graphs is not None and drafter.num_flattened_catch_ups > 0
    assert drafter.graphs is not None and drafter.graphs.runner.tree
    assert drafter.graphs.num_passes > 10


def random_tree(seed: int, nodes: int, max_rank: int = 4) -> list[list[int]]:
    """A random prefix-closed tree of ``nodes`` rank paths (children of a node take ranks
    0, 1, ... in order, at most ``max_rank``)."""
    import random

    rng = random.Random(seed)
    paths: list[tuple[int, ...]] = [()]
    kids: dict[tuple[int, ...], int] = {}
    while len(paths) < nodes + 1:
        parent = rng.choice(paths)
        if kids.get(parent, 0) < max_rank:
            paths.append((*parent, kids.get(parent, 0)))
            kids[parent] = kids.get(parent, 0) + 1
    return [list(p) for p in paths[1:]]


@pytest.mark.parametrize(("seed", "nodes"), [(0, 5), (1, 20), (2, 40)])
def test_random_trees_with_planted_truth_decode_exactly(tiny, head, baseline, monkeypatch,
                                                        seed, nodes):
    """Trees of other shapes (wider, deeper, up to 40 nodes: mask bits past 32), the
    truth planted on the path to their deepest, highest-ranked node: outputs stay those
    of plain decoding, and nodes off the first branch are accepted. (Near max_tokens the
    scheduler cuts a tree to the tokens left, in node order, so the deepest nodes of a
    large tree are not always drafted: the accepted length is checked loosely.)"""
    paths = random_tree(seed, nodes)
    deepest = max(paths, key=lambda p: (len(p), sum(p)))
    moved = plant_truth(monkeypatch, baseline, tree_paths=paths, path=tuple(deepest))
    with tree_llm(tiny, head, tree=paths, num_blocks=96, max_num_seqs=8) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        stats = llm.stats()
    assert stats["spec_mean_accepted_length"] > 2.0 and sum(moved) > 0


def test_first_drafts_after_the_prompt_are_whole_trees(tiny, heads, monkeypatch):
    """A prompt admitted whole gets its draft slots with it, so the tree drafted right
    after it is whole, whatever room the prompt's last block had."""
    got, _ = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS, "eagle3",
                        max_num_seqs=8, tree=TREE, k=len(TREE))
    first = {}
    for (request, seen), drafts in got.items():
        if request not in first or len(seen) < first[request][0]:
            first[request] = (len(seen), drafts)
    assert len(first) == len(PROMPTS)
    assert all(len(drafts) == len(TREE) for _, drafts in first.values())
