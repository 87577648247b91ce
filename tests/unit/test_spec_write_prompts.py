"""``lmkit spec write-prompts``: the model writes its own chat prompts after its template's
opening of a user turn; only turns it closed itself, long enough, new and not among the
benchmark's prompts are kept; the set is reproducible from its seed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from lmkit.api import CHAT_PROMPTS
from lmkit.cli.main import build_app
from lmkit_plugins.spec.self_prompts import user_turn_opening, write_prompts
from typer.testing import CliRunner

ENV = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}


def test_the_opening_is_the_chat_up_to_the_user_message(smollm2_tokenizer):
    opening, closing, text = user_turn_opening(smollm2_tokenizer)
    assert opening.endswith("<|im_start|>user\n")
    assert opening.startswith("<|im_start|>system\n")  # the template's own system prompt
    assert closing == smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert text.startswith("<|im_end|>")


def test_a_turn_closed_by_plain_text_stops_at_that_text(smollm2_tokenizer, monkeypatch):
    """An ``[INST] ... [/INST]`` template closes the user's turn with ordinary tokens:
    no stop token, so sampling stops at the closing text instead."""
    import lmkit

    inst = SimpleNamespace(
        chat_template="{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}",
        encode=smollm2_tokenizer.encode, all_special_ids=smollm2_tokenizer.all_special_ids)
    assert user_turn_opening(inst) == ("[INST] ", None, "[/INST]")
    fake = _ScriptedLLM(inst, [[("What is a comet made of?", "stop")]])
    monkeypatch.setattr(lmkit, "LLM", fake)
    assert write_prompts("m", 1, device="cpu", progress=False) == ["What is a comet made of?"]
    params = fake.calls[0][3]
    assert params.stop == ["[/INST]"] and params.stop_token_ids == []


def test_a_tokenizer_without_a_chat_template_is_refused(smollm2_tokenizer):
    plain = SimpleNamespace(chat_template=None, encode=smollm2_tokenizer.encode)
    with pytest.raises(ValueError, match="no usable chat template"):
        user_turn_opening(plain)


class _ScriptedLLM:
    """Stands in for ``lmkit.LLM``: answers each round with the next scripted list of
    ``(text, finish_reason)`` and records the prompts and seeds it was given."""

    def __init__(self, tokenizer, rounds):
        self.tokenizer, self.rounds, self.calls = tokenizer, list(rounds), []

    def __call__(self, model, **options):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def generate(self, prompts, params):
        self.calls.append((prompts, [p.seed for p in params], params[0].stop_token_ids,
                           params[0]))
        script = self.rounds.pop(0)
        assert len(script) <= len(prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(text=t, finish_reason=f)])
                for t, f in script]


def test_only_closed_long_new_prompts_are_kept(smollm2_tokenizer, monkeypatch, capsys):
    import lmkit

    fake = _ScriptedLLM(smollm2_tokenizer, [
        [("How do tides work?", "stop"),
         ("  how do   TIDES work? ", "stop"),         # the same, case and spaces aside
         ("Write me a very long prompt that", "length"),  # cut by max_tokens
         ("Hi there", "stop"),                       # shorter than min_chars
         (CHAT_PROMPTS[0], "stop"),                  # a benchmark prompt
         ("Name three rivers in Africa.", "stop")],
        [("Name three rivers in Africa.", "stop"),   # already kept in round 1
         ("What is a prime number?", "stop")],
    ])
    monkeypatch.setattr(lmkit, "LLM", fake)
    kept = write_prompts("m", 3, device="cpu", seed=5, progress=True)
    assert kept == ["How do tides work?", "Name three rivers in Africa.",
                    "What is a prime number?"]
    (ids, seeds, stops, first), (_, seeds2, _, _) = fake.calls
    opening, closing, _ = user_turn_opening(smollm2_tokenizer)
    assert first.stop == []  # the stop token closes the turn
    assert ids[0] == {"prompt_token_ids": smollm2_tokenizer.encode(
        opening, add_special_tokens=False)}
    assert stops == [closing]
    # every request its own seed, none reused in the second round
    assert seeds == [5 * 1_000_003 + i for i in range(len(seeds))]
    assert seeds2[0] == seeds[-1] + 1
    assert "3 of 3 kept" in capsys.readouterr().err


def test_too_few_prompts_after_every_round_says_so(smollm2_tokenizer, monkeypatch, capsys):
    import lmkit

    monkeypatch.setattr(lmkit, "LLM", _ScriptedLLM(
        smollm2_tokenizer, [[("Tell me a story about a fox.", "stop")], [("x", "stop")]]))
    assert write_prompts("m", 4, device="cpu", max_rounds=2) == [
        "Tell me a story about a fox."]
    assert "wrote 1 usable prompts of the 4 asked in 2 rounds" in capsys.readouterr().err


def test_the_default_model_writes_reproducible_prompts(smollm2_dir, tmp_path):
    first = write_prompts(str(smollm2_dir), 6, device="cpu", seed=3, max_tokens=48,
                          progress=False)
    assert len(first) == 6 and len({p.lower() for p in first}) == 6
    assert not set(first) & set(CHAT_PROMPTS)
    assert all(len(p) >= 12 and "<|im_" not in p for p in first)
    out = tmp_path / "p.jsonl"
    result = CliRunner().invoke(build_app(env=ENV), [
        "spec", "write-prompts", str(smollm2_dir), "--out", str(out), "--count", "6",
        "--seed", "3", "--max-tokens", "48", "--device", "cpu"], env=ENV)
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stdout and "(6 prompts)" in result.stdout
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == first


@pytest.mark.parametrize("args, message", [
    (["--count", "0"], "--count must be at least 1 (got 0)"),
    (["--temperature", "0"], "--temperature must be above 0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--device", "tpu"], "--device 'tpu': use cpu or cuda"),
])
def test_bad_options_are_refused(tmp_path, args, message):
    result = CliRunner().invoke(build_app(env=ENV), [
        "spec", "write-prompts", "some-model", "--out", str(tmp_path / "p.jsonl"), *args],
        env=ENV)
    assert result.exit_code != 0 and message in result.output, result.output
    assert not (tmp_path / "p.jsonl").exists()


def test_bulk_generation_decodes_more_requests_at_once_on_cuda():
    from lmkit.config.schema import SchedulerConfig
    from lmkit_plugins.spec.self_prompts import BULK_MAX_NUM_SEQS, bulk_llm_options

    assert bulk_llm_options("cpu") == {"device": "cpu", "dtype": "float32"}
    cuda = bulk_llm_options("cuda")
    assert cuda["dtype"] == "bfloat16"
    assert cuda["max_num_seqs"] == BULK_MAX_NUM_SEQS > SchedulerConfig().max_num_seqs


def test_own_prompts_are_written_once_and_read_back(tmp_path, monkeypatch):
    from lmkit_plugins.spec import self_prompts

    calls = []

    def fake_write(model, count, **kw):
        calls.append(count)
        return [f"Prompt number {i} here?" for i in range(count)]

    monkeypatch.setattr(self_prompts, "write_prompts", fake_write)
    assert self_prompts.own_prompts("m", tmp_path, 0, "cpu", 0, False) == []
    first = self_prompts.own_prompts("m", tmp_path, 3, "cpu", 0, False)
    assert first == [f"Prompt number {i} here?" for i in range(3)] and calls == [3]
    # a run started again reads the file; a larger count writes a new set
    assert self_prompts.own_prompts("m", tmp_path, 2, "cpu", 0, False) == first[:2]
    assert calls == [3]
    assert len(self_prompts.own_prompts("m", tmp_path, 5, "cpu", 0, False)) == 5
    assert calls == [3, 5]


@pytest.mark.slow  # the default model writes 3 prompts, answers them, 2 steps (CPU)
def test_train_eagle_trains_on_prompts_the_model_wrote(smollm2_dir, tmp_path):
    import torch

    out = tmp_path / "head"
    result = CliRunner().invoke(build_app(env=ENV), [
        "spec", "train-eagle", str(smollm2_dir), "--out", str(out), "--self-prompts", "3",
        "--max-new-tokens", "16", "--max-steps", "2", "--device", "cpu", "--holdout", "0",
        "--draft-vocab-size", "512"], env=ENV)
    assert result.exit_code == 0, result.output
    written = [json.loads(line)["prompt"] for line in
               (out / "self_prompts.jsonl").read_text().splitlines()]
    assert len(written) == 3 and not set(written) & set(CHAT_PROMPTS)
    data = torch.load(out / "train_data.pt")
    assert len(data["sequences"]) == 3  # only those: no --prompts, so no benchmark prompts
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    shown = [tok.decode(s[:n]) for s, n in zip(data["sequences"], data["prompt_lens"],
                                                strict=True)]
    assert all(p in text for p, text in zip(written, shown, strict=True))
    result = CliRunner().invoke(build_app(env=ENV), [
        "spec", "train-eagle", str(smollm2_dir), "--out", str(out), "--self-prompts", "-1",
        "--device", "cpu"], env=ENV)
    assert result.exit_code != 0 and "--self-prompts must be 0 or more" in result.output
