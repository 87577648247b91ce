"""``lmkit spec train-eagle``'s held-out evaluation: the split (default size, seeded,
disjoint, refusals), the draft accuracy of the unrolled steps against the target's
argmax, the tokens per step it implies, and a training run that writes and prints it."""

from __future__ import annotations

import json

import pytest
import torch
from lmkit.cli.main import build_app
from lmkit.testing.tiny_model import make_tiny_model
from lmkit_plugins.spec.eagle_eval import (
    accuracy_report,
    default_holdout,
    draft_accuracy,
    expected_tokens_per_step,
    holdout_split,
    report_line,
    served_walk,
)
from typer.testing import CliRunner

ENV = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}


def test_default_holdout_is_five_percent_of_large_sets_only():
    assert [default_holdout(n) for n in (1, 40, 99, 100, 1000, 4000)] == [0, 0, 0, 5, 50, 100]


def test_split_is_seeded_disjoint_and_complete():
    train, held = holdout_split(200, None, seed=3)
    assert len(held) == 10 and sorted(train + held) == list(range(200))
    assert holdout_split(200, None, seed=3) == (train, held)  # a resumed run keeps it
    assert holdout_split(200, None, seed=4)[1] != held
    assert holdout_split(30, 0, seed=0) == (list(range(30)), [])
    for bad in (-1, 30):
        with pytest.raises(ValueError, match=rf"--holdout {bad}: keep between 0 and 29 of "
                                             r"the 30 sequences"):
            holdout_split(30, bad, seed=0)


def test_tokens_per_step_chains_the_acceptance_of_each_position():
    assert expected_tokens_per_step([]) == 1.0
    assert expected_tokens_per_step([1.0, 1.0, 1.0]) == 4.0
    assert expected_tokens_per_step([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_step([0.0, 1.0]) == 1.0
    nan = float("nan")
    assert expected_tokens_per_step([0.0, nan, nan]) == 1.0  # later positions never reached
    assert expected_tokens_per_step([0.5, 0.0, nan]) == 1.5


def test_accuracy_counts_the_argmax_of_every_unrolled_step(random_trainable_head):
    head = random_trainable_head
    n = 9
    embeds, taps = torch.randn(n, 32), torch.randn(n, 96)
    with torch.no_grad():
        steps = head.unrolled(embeds, taps, 3)
    # targets the head's own step-0 argmax everywhere: step 0 exact, a later draft of
    # the chain after position s right where its argmax is step 0's at s + j, and
    # accepted only if the chain's earlier drafts were
    target = torch.nn.functional.one_hot(steps[0].argmax(-1), 50).float()
    got = draft_accuracy(head, [lambda: (embeds, taps, target)], 3)
    assert got[0] == 1.0
    right = [steps[j].argmax(-1) == steps[0].argmax(-1)[j:] for j in range(3)]
    assert got[1] == pytest.approx(right[1].float().mean().item())
    both = right[1][:n - 2] & right[2]
    assert got[2] == pytest.approx(both.sum().item() / right[1][:n - 2].sum().item())
    wrong = torch.nn.functional.one_hot((steps[0].argmax(-1) + 1) % 50, 50).float()
    assert draft_accuracy(head, [lambda: (embeds, taps, wrong)], 3)[0] == 0.0
    short = draft_accuracy(head, [lambda: (embeds[:2], taps[:2], target[:2])], 3)
    assert short[0] == 1.0 and short[2] != short[2]  # no position for step 2: nan


class ScriptedHead:
    """A head whose step-``j`` argmax at row ``s`` is ``picks[j][s]`` (one-hot logits over
    a vocabulary of 8): drafting outcomes written out by hand."""

    def __init__(self, picks):
        self.picks = picks

    def unrolled(self, embeds, taps, steps):
        return [torch.nn.functional.one_hot(torch.tensor(p), 8).float()
                for p in self.picks[:steps]]


def test_served_walk_starts_each_chain_where_the_last_stopped():
    """Truth is 0 everywhere (row s predicts the token after position s + 1): a draft is
    right where its pick is 0. The walk starts after the prompt (row ``first``), takes
    right drafts in a row, and starts the next chain after the target's added token --
    counting as the engine does, where draft_accuracy counts every start."""
    truth = torch.zeros(8, dtype=torch.int64)
    # step 0 right at rows 1, 2, 5; step 1 (the chain after s) at rows 1, 4, 5; step 2
    # nowhere: chains after 1 and 5 take two drafts, after 2 one, after 4 none
    picks = [[1, 0, 0, 1, 1, 0, 1, 1], [1, 0, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1]]
    head = ScriptedHead(picks)
    example = lambda: (torch.zeros(8, 4), torch.zeros(8, 4), None, 1, truth)  # noqa: E731
    walk = served_walk(head, [example], 3)
    # s=1: drafts 0, 1 right, 2 wrong -> 3 tokens; s=4: wrong -> 1; s=5: 0, 1 right,
    # step 2 has no row 5 (6 rows) -> 3 tokens; s=8: the end
    assert walk["verifications"] == 3
    assert walk["tokens_per_step"] == pytest.approx(7 / 3)
    # three drafts in each verification (s=5 has 8 - 5 = 3 rows left); position 0 and 1
    # accepted at s=1 and s=5, position 2 never
    assert walk["acceptance_by_position"] == pytest.approx([2 / 3, 2 / 3, 0.0])
    # every start counted instead (rows 1-7): position 0 right at 1, 2, 5 of 7
    assert draft_accuracy(head, [example], 3)[0] == pytest.approx(3 / 7)
    # the report gives both from one pass of the head over each example
    calls = []
    counted = lambda: (calls.append(1), example())[1]  # noqa: E731
    report = accuracy_report(head, [counted], 3)
    assert len(calls) == 1 and report["sequences"] == 1
    assert report["accuracy"] == pytest.approx(draft_accuracy(head, [example], 3), nan_ok=True)
    assert report["served_walk"] == walk


def test_vocab_coverage_counts_the_tokens_to_draft_the_vocabulary_holds():
    """Rows from ``first`` whose truth is a draft id (``-1``: outside the draft
    vocabulary, never draftable), over all examples; the prompt's rows are not counted,
    and examples without ``truth`` give no coverage."""
    head = ScriptedHead([[0] * 8])
    truth_a = torch.tensor([-1, -1, 3, -1, 0, 5, -1, 2])  # from row 2: 4 of 6 inside
    truth_b = torch.tensor([-1, -1, 4, 4, 1, 1, 1, -1])  # from row 4: 3 of 4 inside
    example_a = lambda: (torch.zeros(8, 4), torch.zeros(8, 4), None, 2, truth_a)  # noqa: E731
    example_b = lambda: (torch.zeros(8, 4), torch.zeros(8, 4), None, 4, truth_b)  # noqa: E731
    report = accuracy_report(head, [example_a, example_b], 1)
    assert report["vocab_coverage"] == pytest.approx(7 / 10)
    assert "the draft vocabulary holds 70.0% of the tokens to draft" in report_line(report)
    target = torch.nn.functional.one_hot(torch.zeros(8, dtype=torch.int64), 8).float()
    no_truth = accuracy_report(head, [lambda: (torch.zeros(8, 4), torch.zeros(8, 4), target)],
                               1)
    assert no_truth["vocab_coverage"] is None
    assert "draft vocabulary" not in report_line(no_truth)


@pytest.mark.slow  # trains on the CPU (~10 s)
def test_training_holds_sequences_out_and_reports_their_accuracy(tmp_path):
    tiny = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "head"
    result = CliRunner().invoke(build_app(env=ENV), [
        "spec", "train-eagle", str(tiny), "--out", str(out), "--max-steps", "60",
        "--device", "cpu", "--lr", "3e-3", "--max-new-tokens", "24", "--save-every", "30",
        "--holdout", "6"], env=ENV)
    assert result.exit_code == 0, result.output
    ev = json.loads((out / "eval.json").read_text())
    assert ev["step"] == 60 and ev["sequences"] == 6 and len(ev["accuracy"]) == 3
    assert all(0.0 <= a <= 1.0 for a in ev["accuracy"])
    assert ev["tokens_per_step"] == pytest.approx(expected_tokens_per_step(ev["accuracy"]))
    # the tiny model's whole vocabulary fits the default draft vocabulary
    assert ev["vocab_coverage"] == 1.0
    assert "the draft vocabulary holds 100.0% of the tokens to draft" in result.stdout
    assert "held-out draft accuracy (6 sequences): " in result.stdout
    assert "held-out draft accuracy at step 30 (6 sequences)" in result.stderr
    result = CliRunner().invoke(build_app(env=ENV), [
        "spec", "train-eagle", str(tiny), "--out", str(tmp_path / "h2"), "--device", "cpu",
        "--holdout", "40"], env=ENV)
    assert result.exit_code != 0
    assert "--holdout 40: keep between 0 and 39 of the 40 sequences" in result.output


def test_chains_in_the_prompt_are_not_counted(random_trainable_head):
    """``first`` leaves out the chains that start in the prompt (serving never drafts
    there); a ``truth`` row of -1 (outside the draft vocabulary) is always a miss."""
    head = random_trainable_head
    n, first = 9, 4
    embeds, taps = torch.randn(n, 32), torch.randn(n, 96)
    with torch.no_grad():
        steps = head.unrolled(embeds, taps, 2)
    argmax0 = steps[0].argmax(-1)
    # the target agrees with step 0 only in the answer: counted from row 4 on, exact
    target = torch.nn.functional.one_hot((argmax0 + 1) % 50, 50).float()
    target[first:] = torch.nn.functional.one_hot(argmax0[first:], 50).float()
    assert draft_accuracy(head, [lambda: (embeds, taps, target)], 2)[0] == pytest.approx(
        first_rate(first, n))
    assert draft_accuracy(head, [lambda: (embeds, taps, target, first)], 2)[0] == 1.0
    # truth given: compared instead of the logits' argmax; -1 never matches
    truth = argmax0.clone()
    truth[first] = -1
    got = draft_accuracy(head, [lambda: (embeds, taps, target, first, truth)], 2)
    assert got[0] == pytest.approx((n - first - 1) / (n - first))
    right1 = steps[1].argmax(-1) == truth[1:]
    chains = right1[first:n - 1] & (truth[first:n - 1] != -1)
    assert got[1] == pytest.approx(chains.sum().item() / (n - first - 2))


def first_rate(first: int, n: int) -> float:
    """Step 0's accuracy when every row from ``first`` on is right and none before."""
    return (n - first) / n


@pytest.mark.slow  # trains on the CPU (~10 s)
def test_accuracy_on_another_prompt_set_is_reported_beside(tmp_path):
    """``--eval-prompts``: the target answers that set too (once, kept with the data) and
    each checkpoint reports the head's accuracy there; a resumed run with another set
    answers only that one; a missing file is refused."""
    tiny = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "head"
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps({"prompt": p}) for p in ("abcabc", "hello", "x y z")))
    args = ["spec", "train-eagle", str(tiny), "--out", str(out), "--device", "cpu", "--lr",
            "3e-3", "--max-new-tokens", "16", "--save-every", "20", "--holdout", "4"]
    result = CliRunner().invoke(build_app(env=ENV), [*args, "--max-steps", "20",
                                                     "--eval-prompts", "bench"], env=ENV)
    assert result.exit_code == 0, result.output
    assert "draft accuracy on bench (" in result.stdout
    ev = json.loads((out / "eval.json").read_text())
    assert ev["sequences"] == 4 and ev["eval_prompts"]["source"] == "bench"
    assert 30 <= ev["eval_prompts"]["sequences"] <= 40  # answers of 2 tokens or more
    assert all(0.0 <= a <= 1.0 for a in ev["eval_prompts"]["accuracy"])
    data = torch.load(out / "train_data.pt")
    result = CliRunner().invoke(build_app(env=ENV), [*args, "--max-steps", "40",
                                                     "--eval-prompts", str(other)], env=ENV)
    assert result.exit_code == 0, result.output
    again = torch.load(out / "train_data.pt")
    assert again["sequences"] == data["sequences"]  # the training data stays
    assert again["eval"]["source"] == str(other) and len(again["eval"]["sequences"]) == 3
    assert json.loads((out / "eval.json").read_text())["eval_prompts"]["sequences"] <= 3
    result = CliRunner().invoke(build_app(env=ENV), [*args, "--max-steps", "41",
                                                     "--eval-prompts", str(tmp_path / "no")],
                                env=ENV)
    assert result.exit_code != 0 and "not a file" in result.output
