"""bench/spec_hybrid_sim.py: the walk over served steps for the head's chain, ngram's
lookup, the hybrid (ngram where it matches) and the oracle; a run on a tiny target."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import spec_hybrid_sim as sim  # noqa: E402

# one answer: the prompt is [1, 2, 3, 4] (first drafted row 2: row 0 knows seq[:4]), the
# answer repeats the prompt, so once "1" is known ngram's lookup drafts "2 3 4"
SEQ = [1, 2, 3, 4, 1, 2, 3, 4, 9]
FIRST = 2
# the head's true ranks per row (row s drafts seq[FIRST + s + 2:]): right once, then wrong
PATHS = [[[0, 5, 5]] * 5]


def test_the_head_accepts_up_to_its_first_miss():
    assert sim.leading_zeros([0, 0, 3, 0]) == 2 and sim.leading_zeros([1, 0]) == 0


def test_ngram_drafts_from_an_earlier_occurrence():
    assert sim.ngram_accepted(SEQ, 4, 3, 1, 4) == (0, False)  # "4" never came before
    assert sim.ngram_accepted(SEQ, 5, 3, 1, 4) == (3, True)  # after "1": "2 3 4", right
    assert sim.ngram_accepted(SEQ, 6, 3, 1, 4) == (2, True)  # "3 4 1" against "3 4 9"
    assert sim.ngram_accepted([5, 6, 7], 3, 3, 2, 4) == (0, False)  # no repeat: no lookup


def test_policies_walk_served_steps():
    eagle = sim.served(PATHS, [SEQ], [FIRST], "eagle", 3, 1, 4)
    ngram = sim.served(PATHS, [SEQ], [FIRST], "ngram", 3, 1, 4)
    hybrid = sim.served(PATHS, [SEQ], [FIRST], "hybrid", 3, 1, 4)
    oracle = sim.served(PATHS, [SEQ], [FIRST], "oracle", 3, 1, 4)
    # eagle: steps at rows 0, 2, 4 accept 1 draft each (+1 token)
    assert eagle["tokens_per_step"] == 2.0
    # ngram: nothing at row 0 (+1), then 3 drafts at row 1 (+4)
    assert ngram == {"tokens_per_step": 2.5, "ngram_matched": 0.5}
    # hybrid: the head at row 0 (no lookup: +2), ngram's 2 at row 2 (+3); oracle alike
    assert hybrid["tokens_per_step"] == oracle["tokens_per_step"] == 2.5
    with pytest.raises(ValueError, match="choose from"):
        sim.served(PATHS, [SEQ], [FIRST], "tree", 3, 1, 4)


@pytest.mark.slow  # generates answers and runs a head on the CPU (~15 s)
def test_a_run_on_a_tiny_target_writes_its_report(tmp_path):
    from lmkit.testing.eagle_head import make_tiny_eagle3_head
    from lmkit.testing.tiny_model import make_tiny_model

    tiny = make_tiny_model(tmp_path / "t")
    head = make_tiny_eagle3_head(tmp_path / "h", tiny, draft_vocab_size=None)
    out = tmp_path / "sim.json"
    report = sim.main(["--model", str(tiny), "--speculative-model", str(head), "--count", "3",
                       "--max-new-tokens", "12", "--ngram-sizes", "1-3", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert [r["policy"] for r in report["runs"]] == ["eagle", "ngram", "hybrid", "oracle"]
    assert all(r["tokens_per_step"] >= 1.0 for r in report["runs"])


def test_bad_arguments_are_refused(tmp_path, capsys):
    base = ["--model", "m", "--speculative-model", str(tmp_path)]
    for extra, message in ((["--ngram-sizes", "3-1"], "give MIN-MAX pairs"),
                           (["--ngram-sizes", "x"], "give MIN-MAX pairs"),
                           (["--k", "0"], "--k must be at least 1")):
        with pytest.raises(SystemExit):
            sim.main(base + extra)
        assert message in capsys.readouterr().err
