"""``lmkit spec fit-tree``: the best static draft tree for an EAGLE-3 head on the
target's own answers, printed as JSON that ``--spec-tree`` takes (inline or as the file
``--out`` writes), with its held-out score beside a chain; bad input refused in one
line before any answer is generated."""

from __future__ import annotations

import json

import pytest
from lmkit.cli.main import build_app
from lmkit.config.schema import SpeculativeConfig
from lmkit.spec_decode.tree import DraftTree
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head
from lmkit.testing.tiny_model import make_tiny_model
from typer.testing import CliRunner

ENV = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}


def _cli(*args):
    return CliRunner().invoke(build_app(env=ENV), [str(a) for a in args], env=ENV)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("fit-tree")
    tiny = make_tiny_model(base / "t")
    return tiny, make_tiny_eagle3_head(base / "h", tiny, draft_vocab_size=None)


@pytest.mark.slow  # generates answers and runs the head on the CPU (~10 s)
def test_fit_tree_prints_a_tree_the_config_takes(pair, tmp_path):
    tiny, head = pair
    out = tmp_path / "tree.json"
    got = _cli("spec", "fit-tree", tiny, "--speculative-model", head, "--nodes", 5,
               "--count", 4, "--max-new-tokens", 12, "--depth", 3, "--max-rank", 10000,
               "--device", "cpu", "--out", out)
    assert got.exit_code == 0, got.output
    tree = json.loads(got.stdout.strip().splitlines()[-1])
    assert 1 <= len(tree) <= 5 and DraftTree.from_paths(tree).num_nodes == len(tree)
    assert json.loads(out.read_text()) == tree
    assert "tokens per step on held-out answers, a chain of" in got.stderr
    assert SpeculativeConfig(tree=str(out)).tree == tree  # --spec-tree FILE


def test_fit_tree_refuses_bad_input_before_generating(pair, tmp_path):
    tiny, head = pair
    eagle1 = make_tiny_eagle_head(tmp_path / "e1", tiny)
    cases = [
        (["--speculative-model", head, "--nodes", 0], "--nodes must be in [1, 63] (got 0)"),
        (["--speculative-model", head, "--nodes", 64], "--nodes must be in [1, 63] (got 64)"),
        (["--speculative-model", tmp_path], "not an EAGLE-3 head directory"),
        (["--speculative-model", eagle1], "not an EAGLE-3 head (its config.json has no"),
        (["--speculative-model", head, "--prompts", tmp_path / "none.jsonl"], "none.jsonl"),
    ]
    for args, message in cases:
        got = _cli("spec", "fit-tree", tiny, "--device", "cpu", *args)
        assert got.exit_code == 2, got.output
        assert message in got.output.replace("\n", " ") or message in got.stderr.replace(
            "\n", " "), got.output
