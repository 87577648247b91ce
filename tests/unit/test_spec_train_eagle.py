"""``lmkit spec train-eagle``: the unrolled training steps equal drafting as the runner
does it, and a head trained on the tiny model (CPU, seconds) loads with ``--speculative
eagle3``, keeps outputs exact and is accepted far more often than a random head;
training resumes from its checkpoint."""

from __future__ import annotations

import pytest
import torch
from lmkit import LLM, SamplingParams
from lmkit.api import CHAT_PROMPTS
from lmkit.cli.main import build_app
from lmkit.testing.eagle_head import make_tiny_eagle3_head
from lmkit.testing.tiny_model import make_tiny_model
from torch.nn import functional as F
from typer.testing import CliRunner

ENV = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}


def _drafted(head, embeds, feature0, p, j):
    """Step ``j``'s draft logits at position ``p`` computed as drafting does: real
    features up to ``p - j``, then ``j`` chained passes, each attending to all keys so
    far (dense, one position at a time)."""
    positions = torch.arange(p - j + 1)
    q, k, v = head.qkv(embeds[:p - j + 1], feature0[:p - j + 1], positions)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    hidden = head.finish(out, feature0[:p - j + 1])[-1:]
    keys, values = k, v
    for pos in range(p - j + 1, p + 1):
        q, k, v = head.qkv(embeds[pos:pos + 1], hidden, torch.tensor([pos]))
        keys, values = torch.cat((keys, k), 1), torch.cat((values, v), 1)
        out = F.scaled_dot_product_attention(q, keys, values)
        hidden = head.finish(out, hidden)
    return head.logits(hidden)[0]


def test_unrolled_steps_equal_chained_drafting(random_trainable_head):
    head = random_trainable_head
    n = 9
    embeds, taps = torch.randn(n, 32), torch.randn(n, 96)
    with torch.no_grad():
        steps = head.unrolled(embeds, taps, 3)
        feature0 = head.fc(taps)
        for j, logits in enumerate(steps):
            assert logits.shape == (n - j, 50)
            for p in range(j, n):
                torch.testing.assert_close(logits[p - j], _drafted(head, embeds, feature0, p, j),
                                           rtol=1e-4, atol=1e-4)


def test_a_padded_batch_loses_what_its_sequences_lose_one_by_one(random_trainable_head):
    """The batch loss (one padded forward) is the sum of the sequences' own losses: no
    real row reads padding, and padding rows count nowhere (gradients too)."""
    from lmkit_plugins.spec.eagle_trainable import distill_loss

    head = random_trainable_head
    torch.manual_seed(0)
    lengths = (9, 2, 5)  # the short one has fewer unrolled steps than ttt_steps
    embeds = [torch.randn(m, 32) for m in lengths]
    taps = [torch.randn(m, 96) for m in lengths]
    want = [torch.softmax(torch.randn(m, 50), -1) for m in lengths]
    batch = distill_loss(head, embeds, taps, want, 3, 3)
    batch.backward()
    grads = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    alone = sum(distill_loss(head, [e], [t], [w], 3, 3)
                for e, t, w in zip(embeds, taps, want, strict=True))
    alone.backward()
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-6)
    for got, expect in zip(grads, (p.grad for p in head.parameters()), strict=True):
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # trains twice on the CPU (~20 s)
def test_trained_head_drafts_well_and_training_resumes(tmp_path):
    from lmkit_plugins.spec.train_eagle import train

    tiny = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "head"
    first = train(str(tiny), out, max_steps=100, device="cpu", max_new_tokens=48, lr=3e-3,
                  save_every=50, progress=False)
    assert first["resumed_from"] is None and (out / "model.safetensors").is_file()
    again = train(str(tiny), out, max_steps=400, device="cpu", max_new_tokens=48, lr=3e-3,
                  save_every=100, progress=False)
    assert again["resumed_from"] == 100 and again["step"] == 400
    with pytest.raises(ValueError, match="holds a training run for model"):
        train("another-model", out, max_steps=500, device="cpu", progress=False)
    random_head = make_tiny_eagle3_head(tmp_path / "random", tiny, layer_ids=(1, 1, 0))
    params = SamplingParams(temperature=0.0, max_tokens=48)
    prompts = list(CHAT_PROMPTS[:6])  # the model's own answers: what the head learned
    common = dict(device="cpu", dtype="float32", max_model_len=256, num_blocks=400,
                  block_size=4)
    with LLM(str(tiny), **common) as llm:
        base = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    rates = {}
    for name, head in (("trained", out), ("random", random_head)):
        with LLM(str(tiny), speculative="eagle3", speculative_model=str(head),
                 num_speculative_tokens=3, **common) as llm:
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == base
            rates[name] = llm.stats()["spec_acceptance_rate_pos_0"]
    # deterministic on the CPU: 0.19 at the time of writing, a random head 0.0
    assert rates["trained"] > 0.12 > rates["random"], rates
    # the command line: resumes, says so, and refuses what it cannot do
    result = CliRunner().invoke(build_app(env=ENV), [
        "spec", "train-eagle", str(tiny), "--out", str(out), "--max-steps", "401",
        "--device", "cpu", "--lr", "3e-3"], env=ENV)
    assert result.exit_code == 0, result.output
    assert "step 401" in result.stdout and "resumed from step 400" in result.stdout
    result = CliRunner().invoke(build_app(env=ENV), [
        "spec", "train-eagle", str(tiny), "--out", str(out), "--device", "tpu"], env=ENV)
    assert result.exit_code != 0 and "--device 'tpu': use cpu or cuda" in result.output


def test_progress_in_a_log_is_one_line_per_tenth(capsys):
    """Not a terminal (a log, a pipe): plain lines, so long GPU runs show progress."""
    from lmkit_plugins.spec.train_eagle import _progress

    update = _progress(True, 50, 0)
    for step in range(1, 51):
        update(step, lambda step=step: 6.0 - step / 50)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 10 and lines[0].startswith("lmkit: training EAGLE-3 head: step 5 of 50 (10%)")
    assert "step 50 of 50 (100%), loss 5.0000" in lines[-1]


@pytest.mark.slow  # five short trainings on the CPU (~7 s)
def test_cached_features_train_exactly_like_the_target_every_step(tmp_path, monkeypatch):
    """The feature cache holds what the target's forward returns: training over it in
    memory or in memory-mapped files gives exactly the same losses, step for step (the
    same seed), and the same as running the target over each step's sequences up to
    float rounding (those forwards batch other sequences together: padded differently,
    the sums round differently); a resumed run reuses the files on disk without
    running the target again."""
    import shutil

    from lmkit_plugins.spec.eagle_features import TargetFeatures
    from lmkit_plugins.spec.train_eagle import train

    tiny = make_tiny_model(tmp_path / "tiny")
    common = dict(max_steps=6, device="cpu", max_new_tokens=16, lr=3e-3, batch_size=3,
                  save_every=3, progress=False, feature_batch=4)
    runs = {}
    forwards = {"sequences": 0}
    call = TargetFeatures.__call__

    def counted(self, sequences):
        forwards["sequences"] += len(sequences)
        return call(self, sequences)

    monkeypatch.setattr(TargetFeatures, "__call__", counted)
    for mode in ("off", "memory", "disk"):
        out = tmp_path / mode
        if runs:  # the same generated data (greedy answers) for every run
            out.mkdir()
            shutil.copy(tmp_path / "off" / "train_data.pt", out / "train_data.pt")
        forwards["sequences"] = 0
        runs[mode] = train(str(tiny), out, feature_cache=mode, **common)
        assert runs[mode]["feature_cache"] == mode and len(runs[mode]["losses"]) == 6
        num_sequences = len(torch.load(out / "train_data.pt")["sequences"])
        # off: each step's sequences; cached: every sequence once
        assert forwards["sequences"] == (18 if mode == "off" else num_sequences)
    assert runs["disk"]["losses"] == runs["memory"]["losses"]
    torch.testing.assert_close(runs["memory"]["losses"], runs["off"]["losses"], rtol=1e-5,
                               atol=0)
    assert runs["memory"]["losses"][0] != runs["memory"]["losses"][-1]  # it trained
    assert (tmp_path / "disk" / "features" / "index.json").is_file()
    forwards["sequences"] = 0
    resumed = train(str(tiny), tmp_path / "disk", feature_cache="disk",
                    **{**common, "max_steps": 8})
    assert resumed["resumed_from"] == 6 and forwards["sequences"] == 0
    # a cache too large for --feature-cache-gb goes to disk
    tiny_gb = train(str(tiny), tmp_path / "memory", feature_cache="memory",
                    feature_cache_gb=1e-9, **{**common, "max_steps": 7})
    assert tiny_gb["feature_cache"] == "disk" and tiny_gb["resumed_from"] == 6


def test_feature_cache_progress_is_one_line_per_tenth(capsys):
    """Building the feature cache of a large prompt set reports its progress too."""
    from lmkit_plugins.spec.eagle_features import _reporter

    report = _reporter(True, 40)
    for done in (16, 32, 40):  # batches of 16 sequences, the last of 8
        report(done)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("lmkit: target features: 16 of 40 sequences (40%)")
    assert lines[-1].startswith("lmkit: target features: 40 of 40 sequences (100%)")
    assert len(lines) == 3


def test_feature_cache_options_are_checked(tmp_path):
    """Wrong feature-cache options are refused before anything runs, naming the choices."""
    for args, message in ((["--feature-cache", "ram"],
                           "--feature-cache 'ram': use one of memory, disk, off"),
                          (["--feature-batch", "0"], "--feature-batch must be at least 1"),
                          (["--feature-cache-gb", "-1"], "--feature-cache-gb must be 0 or more"),
                          (["--lr-schedule", "linear"],
                           "--lr-schedule 'linear': use one of constant, cosine"),
                          (["--warmup-steps", "-2"], "--warmup-steps must be 0 or more")):
        result = CliRunner().invoke(build_app(env=ENV), [
            "spec", "train-eagle", "some-model", "--out", str(tmp_path / "head"),
            "--device", "cpu", *args], env=ENV)
        assert result.exit_code != 0 and message in result.output, result.output
    assert not (tmp_path / "head").exists()


def test_prompt_rows_are_context_and_never_trained(random_trainable_head):
    """With ``first``, a sequence's rows before it add nothing to the loss (changing their
    targets changes nothing) but still feed the answer rows (changing their inputs does)."""
    from lmkit_plugins.spec.eagle_trainable import distill_loss

    head = random_trainable_head
    torch.manual_seed(1)
    embeds, taps = [torch.randn(8, 32)], [torch.randn(8, 96)]
    want = [torch.softmax(torch.randn(8, 50), -1)]
    base = distill_loss(head, embeds, taps, want, 3, 1, [3])
    other = want[0].clone()
    other[:3] = torch.softmax(torch.randn(3, 50), -1)
    assert distill_loss(head, embeds, taps, [other], 3, 1, [3]) == base
    assert distill_loss(head, embeds, taps, [other], 3, 1, [0]) != \
        distill_loss(head, embeds, taps, want, 3, 1, [0])
    moved = embeds[0].clone()
    moved[0] += 1.0
    assert distill_loss(head, [moved], taps, want, 3, 1, [3]) != base
    # a first row past every step's rows: nothing trains
    assert distill_loss(head, embeds, taps, want, 3, 1, [8]) == 0


def test_answer_rows_start_at_the_last_prompt_token(capsys):
    from lmkit_plugins.spec.train_eagle import answer_rows

    data = {"sequences": [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4], [7, 8, 9]],
            "prompt_lens": [3, 3, 1]}
    # row p predicts token p + 2; the first answer token (index 3) is the target's, so
    # drafting starts with token 4: row 2 = prompt length - 1; one answer token: dropped
    assert answer_rows(data, progress=True) == ([[1, 2, 3, 4, 5, 6], [7, 8, 9]], [2, 0])
    assert capsys.readouterr().err == ""
    old = {"sequences": data["sequences"] + [[1, 2]]}  # before prompt lengths were kept
    assert answer_rows(old, progress=True) == (data["sequences"], [0, 0, 0])
    assert "no prompt lengths" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no answer of 2 tokens or more"):
        answer_rows({"sequences": [[1, 2, 3]], "prompt_lens": [2]}, progress=False)


def test_learning_rate_warms_up_then_stays_or_decays():
    from lmkit_plugins.spec.train_eagle import learning_rate

    assert [learning_rate(1.0, s, 100, "constant", 0) for s in (0, 50, 99)] == [1.0] * 3
    assert [learning_rate(1.0, s, 100, "constant", 4) for s in (0, 1, 3, 50)] == \
        [0.25, 0.5, 1.0, 1.0]
    cosine = [learning_rate(2.0, s, 100, "cosine", 0) for s in (0, 50, 100)]
    assert cosine == pytest.approx([2.0, 1.0, 0.0], abs=1e-12)
    decaying = [learning_rate(1.0, s, 100, "cosine", 10) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(decaying, decaying[1:], strict=False))
    assert learning_rate(1.0, 4, 100, "cosine", 10) < learning_rate(1.0, 9, 100, "cosine", 10)
