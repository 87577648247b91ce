"""Draft trees under tensor parallelism (``mp`` executor over gloo, two ranks): every
rank drafts the same tree with its whole copy of the head, verifies it over its share of
the target's heads with the same tree mask, walks the same path (the logits are
all-gathered, the generators seeded alike) and moves the accepted nodes' K/V within its
own share of the cache, so outputs and drafts equal one rank's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from eagle_engine import COMMON, GREEDY, PROMPTS, regex_case, run_engine, tokens
from lmkit import LLM, SamplingParams

pytestmark = pytest.mark.slow  # worker processes

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]]
HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_trees_at_tp2_equal_one_rank(tiny, heads, monkeypatch, proposer):
    one, stats_one = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                                max_num_seqs=4, tree=TREE, k=len(TREE))
    two, stats_two = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                                parallel={"tensor_parallel_size": 2}, max_num_seqs=4,
                                tree=TREE, k=len(TREE))
    assert (stats_one["executor"], stats_two["executor"]) == ("uniproc", "mp")
    assert len(one) > 20 and two == one
    for key in ("spec_num_draft_tokens", "spec_num_accepted_tokens"):
        assert stats_two[key] == stats_one[key], key
    assert stats_one["spec_num_draft_tokens"] > len(TREE) * 10


def plant_in_workers(monkeypatch, tmp_path, prompts, outputs) -> None:
    """Plant the truth (``prompts`` and their plain ``outputs``) on nodes (1,), (1, 0),
    (1, 0, 0) in every worker's runner: the workers load ``tp_site/sitecustomize.py``."""
    truth = [list(p.encode()) + out for p, out in zip(prompts, outputs, strict=True)]
    spec = tmp_path / "oracle.json"
    spec.write_text(json.dumps({"truth": truth, "tree": TREE, "path": [1, 0, 0],
                                "tests": str(HERE)}))
    monkeypatch.setenv("LMKIT_TEST_TREE_ORACLE", str(spec))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(HERE / "tp_site"), os.environ.get("PYTHONPATH")) if p))


def tp2_tree_llm(tiny, head, **settings):
    return LLM(str(tiny), speculative="eagle", speculative_model=str(head),
               speculative_tree=TREE, tensor_parallel_size=2, num_blocks=96, max_num_seqs=8,
               progress=False, **{**COMMON, "max_model_len": 64, **settings})


def test_accepted_nodes_move_on_every_rank(tiny, head, baseline, monkeypatch, tmp_path):
    """With the truth planted off the first branch every step accepts such nodes, every
    rank moves their K/V within its share of the cache, and the outputs stay plain
    decoding's."""
    plant_in_workers(monkeypatch, tmp_path, PROMPTS, baseline)
    with tp2_tree_llm(tiny, head) as llm:
        assert llm.engine.stack.get("executor").name == "mp"
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        stats = llm.stats()
    assert stats["spec_mean_accepted_length"] > 3.0  # nodes off the first branch, taken


def test_constrained_trees_at_tp2(tiny, head, monkeypatch, tmp_path):
    """A regex constraint over trees at TP=2: every rank gets each node's grammar row
    with the step, and the outputs are those decoded at TP=1 without speculation."""
    pytest.importorskip("xgrammar")
    prompts, params, base = regex_case(tiny)
    plant_in_workers(monkeypatch, tmp_path, prompts, base)
    with tp2_tree_llm(tiny, head, structured_output="auto") as llm:
        assert tokens(llm.generate(prompts, params)) == base
        stats = llm.stats()
    assert stats["grammar_drafts_trimmed"] == 0 and stats["spec_mean_accepted_length"] > 2.5


def test_sampled_trees_at_tp2_equal_one_rank(tiny, heads, monkeypatch):
    """A sampled walk draws from the requests' seeded generators on every rank, so
    every rank accepts the same nodes."""
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(PROMPTS))]
    one, stats_one = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS, "eagle3",
                                params=params, tree=TREE, k=len(TREE))
    two, stats_two = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS, "eagle3",
                                params=params, parallel={"tensor_parallel_size": 2},
                                tree=TREE, k=len(TREE))
    assert stats_two["executor"] == "mp" and len(one) > 20 and two == one
    assert stats_two["spec_num_accepted_tokens"] == stats_one["spec_num_accepted_tokens"]
