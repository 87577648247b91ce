"""bench/eagle_tree_sim.py on the CPU: true ranks (ties as argmax takes them, misses),
trees built from rank-prefix counts (closed under parents, the most frequent first),
the served walk over a tree (a chain equals eagle_eval's served walk), and a whole run
on a tiny target with a random head."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from lmkit_plugins.spec.eagle_eval import served_walk

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import eagle_tree_sim as sim  # noqa: E402
from lmkit_plugins.spec import tree_fit  # noqa: E402


def test_rank_is_the_true_tokens_place_among_the_logits():
    logits = torch.tensor([[0.1, 0.9, 0.5, 0.9],   # truth 3: 0.9 at id 1 comes first
                           [0.3, 0.2, 0.1, 0.0],   # truth 0: the argmax
                           [0.0, 0.0, 0.0, 1.0]])  # truth -1: never draftable
    step1 = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # rows 1..2
    truth = torch.tensor([3, 0, -1])
    got = tree_fit.rank_paths([logits, step1], truth)
    # step 0: row 0's 0.9 ties with id 1's, which argmax takes first -> rank 1; row 1
    # -> 0; row 2 -> MISS
    assert got[:, 0].tolist() == [1, 0, tree_fit.MISS]
    # step 1 row s is the chain after s, predicting truth[s + 1]: row 0 wants 0 (logits
    # of its row: id 1 is above) -> 1; row 1 wants -1 -> MISS; row 2 has no step-1 row
    assert got[:, 1].tolist() == [1, tree_fit.MISS, tree_fit.MISS]


def test_best_tree_is_the_most_frequent_prefixes_and_closed_under_parents():
    paths = [torch.tensor([[0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0], [0, 9, 0]])]
    counts = tree_fit.prefix_counts(paths, max_rank=4)
    assert counts[(0,)] == 4 and counts[(0, 0)] == 2 and counts[(1,)] == 1
    assert (0, 9) not in counts  # rank 9 is past max_rank: the path stops there
    for n in range(1, len(counts) + 1):
        tree = tree_fit.best_tree(counts, n)
        assert len(tree) == n
        assert all(p[:-1] in tree for p in tree if len(p) > 1)
    assert tree_fit.best_tree(counts, 2) == {(0,), (0, 0)}


def test_walk_accepts_the_longest_prefix_in_the_tree():
    # row 0's path (0, 1, 5): a chain takes one draft, a tree with (0, 1) two
    paths = [torch.tensor([[0, 1, 5], [2, 0, 0], [0, 0, 0], [7, 7, 7]])]
    got = tree_fit.served_tokens(paths, tree_fit.chain(3))
    # s=0: 1 accepted -> 2 tokens, s=2: 3 accepted... (0,0,0) -> 4 tokens, s=6: end
    assert got == {"tokens_per_step": 3.0, "steps": 2}
    tree = tree_fit.chain(3) | {(0, 1)}
    # s=0: (0, 1) in, (0, 1, 5) not -> 3 tokens; s=3: (7,) not -> 1 token
    assert tree_fit.served_tokens(paths, tree) == {"tokens_per_step": 2.0, "steps": 2}
    assert tree_fit.served_tokens([], tree)["steps"] == 0


def test_a_chain_walks_as_eagle_evals_served_walk(random_trainable_head):
    head = random_trainable_head
    torch.manual_seed(1)
    embeds, taps = torch.randn(12, 32), torch.randn(12, 96)
    with torch.no_grad():
        steps = head.unrolled(embeds, taps, 3)
    # truth: the head's own argmax mostly, so that chains run
    truth = steps[0].argmax(-1).clone()
    truth[[3, 7]] = (truth[[3, 7]] + 1) % 50
    truth[9] = -1
    first = 2
    paths = [tree_fit.rank_paths(steps, truth)[first:]]
    want = served_walk(head, [lambda: (embeds, taps, None, first, truth)], 3)
    got = tree_fit.served_tokens(paths, tree_fit.chain(3))
    assert got["steps"] == want["verifications"]
    assert got["tokens_per_step"] == pytest.approx(want["tokens_per_step"])


def test_simulate_scores_trees_no_worse_than_their_chain_on_the_fit_half():
    gen = torch.Generator().manual_seed(0)
    paths = [torch.randint(0, 3, (40, 4), generator=gen) for _ in range(6)]
    report = sim.simulate(paths, nodes=[2, 6, 20], depth=4, max_rank=3)
    assert report["answers"] == 6 and report["held_rows"] == 120
    chains = [r for r in report["rows"] if r["kind"] == "chain"]
    trees = [r for r in report["rows"] if r["kind"] == "tree"]
    assert [r["nodes"] for r in chains] == [1, 2, 3, 4]
    assert [r["nodes"] for r in trees] == [2, 6, 20]
    fits = [r["fit"] for r in trees]
    assert fits == sorted(fits) and fits[-1] > chains[-1]["fit"]
    assert 0.0 < report["first_draft"]["top1"] < report["first_draft"]["top3"] == 1.0


@pytest.mark.slow  # generates answers and runs a head on the CPU (~15 s)
def test_a_run_on_a_tiny_target_writes_its_report(tmp_path):
    from lmkit.testing.eagle_head import make_tiny_eagle3_head
    from lmkit.testing.tiny_model import make_tiny_model

    tiny = make_tiny_model(tmp_path / "t")
    head = make_tiny_eagle3_head(tmp_path / "h", tiny, draft_vocab_size=None)
    out = tmp_path / "sim.json"
    report = sim.main(["--model", str(tiny), "--speculative-model", str(head), "--count", "4",
                       "--max-new-tokens", "12", "--depth", "3", "--nodes", "2,5",
                       "--max-rank", "10000", "--out", str(out)])  # a random head: any rank
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["answers"] == 4 and report["held_rows"] > 0
    assert [(r["kind"], r["nodes"]) for r in report["rows"]][-2:] == [("tree", 2), ("tree", 5)]
    assert all(r["held"] >= 1.0 for r in report["rows"])


def test_bad_arguments_are_refused(tmp_path, capsys):
    base = ["--model", "m", "--speculative-model", str(tmp_path)]
    for extra, message in ((["--nodes", "4,x"], "--nodes '4,x': give comma-separated"),
                           (["--depth", "0"], "--depth must be at least 1, got 0"),
                           (["--nodes", "4,0"], "--nodes must be at least 1, got 0")):
        with pytest.raises(SystemExit):
            sim.main(base + extra)
        assert message in capsys.readouterr().err
