"""Bad input to ``lmkit spec train-eagle`` / ``write-prompts`` and to the EAGLE head
loaders is refused with one readable line naming the bad value (exit code 2 on the
command line), before the expensive work where it can be; a run in ``--out`` resumes
only with what it was made with; nothing unreadable is silently taken."""

from __future__ import annotations

import json
import shutil

import pytest
from lmkit import LLM
from lmkit.cli.main import build_app
from lmkit.errors import ConfigError
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head
from lmkit.testing.tiny_model import make_tiny_model
from typer.testing import CliRunner

ENV = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
TINY = ["--device", "cpu", "--batch-size", "2", "--holdout", "0"]


def _cli(*args):
    return CliRunner().invoke(build_app(env=ENV), [str(a) for a in args], env=ENV)


def _train(model, out, *args):
    return _cli("spec", "train-eagle", model, "--out", out, *TINY, *args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("probe-tiny"))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe-prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Tell me about topic {i}, please."}) + "\n"
                            for i in range(5)))
    return path


@pytest.fixture(scope="module")
def run(tiny, prompts, tmp_path_factory):
    """A run of 2 steps (draft vocabulary 50, features on disk), after a first attempt
    whose answers were all empty left nothing behind."""
    out = tmp_path_factory.mktemp("probe-run") / "head"
    result = _train(tiny, out, "--prompts", prompts, "--max-new-tokens", "1",
                    "--max-steps", "2", "--draft-vocab-size", "50")
    assert result.exit_code == 2, result.output
    assert "gave no answer of 2 tokens or more" in result.output
    assert "raise --max-new-tokens" in result.output
    assert not (out / "train_data.pt").exists()  # so the fixed command is not stuck on it
    result = _train(tiny, out, "--prompts", prompts, "--max-new-tokens", "8",
                    "--max-steps", "2", "--draft-vocab-size", "50", "--feature-cache", "disk")
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("text, message", [
    ("not json\n", "p.jsonl:1: not JSON (Expecting value)"),
    ('{"prompt": "fine"}\n{"prompt": "  "}\n', "p.jsonl:2: the prompt is empty"),
    ("", "p.jsonl: no prompt to answer"),
    ("\n\n", "p.jsonl: no prompt to answer"),
])
def test_bad_prompt_files_are_refused_before_the_target_runs(tmp_path, text, message):
    (tmp_path / "p.jsonl").write_text(text)
    result = _train("no-such-model", tmp_path / "head", "--prompts", tmp_path / "p.jsonl",
                    "--eval-prompts", "bench")
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "head" / "train_data.pt").exists()


def test_prompt_files_that_are_not_text_or_empty_eval_sets_are_named(tmp_path, prompts):
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\n")
    result = _train("no-such-model", tmp_path / "head", "--prompts", tmp_path / "bin.jsonl")
    assert result.exit_code == 2 and "bin.jsonl: not UTF-8 text" in result.output
    (tmp_path / "none.jsonl").write_text("")
    result = _train("no-such-model", tmp_path / "head", "--prompts", prompts,
                    "--eval-prompts", tmp_path / "none.jsonl")
    assert result.exit_code == 2, result.output
    assert "--eval-prompts" in result.output and "no prompt to answer" in result.output


def test_out_that_is_a_file_and_bad_learning_rates_are_refused(tmp_path, prompts):
    (tmp_path / "file").write_text("x")
    result = _train("no-such-model", tmp_path / "file", "--prompts", prompts)
    assert result.exit_code == 2 and "--out" in result.output
    assert "not a directory" in result.output
    for lr in ("nan", "0", "-1", "inf"):
        result = _train("no-such-model", tmp_path / "head", "--lr", lr)
        assert result.exit_code == 2 and f"--lr must be a number above 0 (got {float(lr)})" \
            in result.output, result.output
    assert not (tmp_path / "head").exists()


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_write_prompts_refuses_a_temperature_that_is_not_finite(tmp_path, value):
    result = _cli("spec", "write-prompts", "no-such-model", "--out", tmp_path / "p.jsonl",
                  "--temperature", value)
    assert result.exit_code == 2, result.output
    assert f"--temperature must be above 0 and finite (got {float(value)})" in result.output


def test_a_resume_that_asks_for_other_settings_is_refused(run, tiny, prompts, tmp_path):
    same = ["--prompts", prompts, "--max-new-tokens", "8"]
    cases = [
        (["--max-steps", "4", *same], "--draft-vocab-size 32000: the run in"),
        (["--max-steps", "1", "--draft-vocab-size", "50", *same],
         "--max-steps 1 is below step 2"),
        (["--max-steps", "4", "--draft-vocab-size", "50", "--max-new-tokens", "8"],
         "not to lmkit bench's chat prompts"),
    ]
    for args, message in cases:
        result = _train(tiny, run, *args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    other = tmp_path / "other.jsonl"
    shutil.copy(prompts, other)  # the same prompts from another path: compared by content
    copy = tmp_path / "run-copy"
    shutil.copytree(run, copy)
    result = _train(tiny, copy, "--max-steps", "2", "--draft-vocab-size", "50",
                    "--prompts", other, "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    other.write_text(other.read_text() + '{"prompt": "one more"}\n')
    result = _train(tiny, run, "--max-steps", "4", "--draft-vocab-size", "50",
                    "--prompts", other)
    assert result.exit_code == 2 and f"holds answers to --prompts {prompts}" in result.output


@pytest.mark.parametrize("name, remedy", [("train_state.pt", "delete it to start training over"),
                                          ("train_data.pt", "delete it to generate")])
def test_a_corrupt_run_file_is_refused_with_the_remedy(run, tiny, prompts, tmp_path, name,
                                                       remedy):
    out = tmp_path / "copy"
    shutil.copytree(run, out)
    (out / name).write_bytes((run / name).read_bytes()[:100])  # truncated
    result = _train(tiny, out, "--prompts", prompts, "--max-new-tokens", "8",
                    "--max-steps", "3", "--draft-vocab-size", "50")
    assert result.exit_code == 2, result.output
    assert f"{name} is unreadable" in result.output and remedy in result.output


def test_a_garbled_feature_index_is_rebuilt_and_the_run_resumes(run, tiny, prompts, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(run, out)
    (out / "features" / "index.json").write_text("{half written")
    result = _train(tiny, out, "--prompts", prompts, "--max-new-tokens", "8",
                    "--max-steps", "3", "--draft-vocab-size", "50", "--feature-cache", "disk")
    assert result.exit_code == 0, result.output
    assert "resumed from step 2" in result.stdout
    assert json.loads((out / "features" / "index.json").read_text())["complete"] is True


def _edit(head, edit_config=None, drop=None):
    if edit_config is not None:
        config = json.loads((head / "config.json").read_text())
        edit_config(config)
        (head / "config.json").write_text(json.dumps(config))
    if drop is not None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(head / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(head / "model.safetensors"))
    return head


def test_heads_that_do_not_fit_are_refused_before_weights_load(tiny, tmp_path, monkeypatch):
    import lmkit.loading.weights as weights

    def no_weights(*_):
        raise AssertionError("a refused head must fail before any weights load")

    monkeypatch.setattr(weights, "iterate_weights", no_weights)

    def taps(value):
        return lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": value})

    cases = [
        # a string of digits was read as layers (0, 1)
        ("eagle3", _edit(make_tiny_eagle3_head(tmp_path / "a", tiny), taps("01")),
         r"eagle_aux_hidden_state_layer_ids is '01'; expected a list of target layer"),
        ("eagle3", _edit(make_tiny_eagle3_head(tmp_path / "b", tiny), taps("x")),
         r"eagle_aux_hidden_state_layer_ids is 'x'"),
        ("eagle3", _edit(make_tiny_eagle3_head(tmp_path / "c", tiny),
                         lambda c: c.update(draft_vocab_size="many")),
         r"draft_vocab_size is 'many'; expected a positive whole number"),
        ("eagle3", _edit(make_tiny_eagle3_head(tmp_path / "d", tiny), drop="norm.weight"),
         r"does not fit the target model: the checkpoint has no norm.weight"),
        ("eagle3", _edit(make_tiny_eagle3_head(tmp_path / "e", tiny),
                         drop="midlayer.hidden_norm.weight"),
         r"the checkpoint has no midlayer.hidden_norm.weight"),
        ("eagle", _edit(make_tiny_eagle_head(tmp_path / "f", tiny),
                        drop="layers.0.mlp.down_proj.weight"),
         r"the checkpoint has no layers.0.mlp.down_proj.weight"),
    ]
    for proposer, head, message in cases:
        with pytest.raises(ConfigError, match=message):
            LLM(str(tiny), speculative=proposer, speculative_model=str(head), device="cpu",
                dtype="float32", num_blocks=64, max_model_len=64)
