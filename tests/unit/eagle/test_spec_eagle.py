"""``--speculative eagle`` on the tiny random Llama with a random EAGLE head
(:mod:`lmkit.testing.eagle_head`): lossless greedy outputs across batch sizes, prefix
caching and preemption, ``n > 1``, sampled outputs that follow the target's
distribution, the mp executor, grammars and pooling beside drafting; refusals before any
weights load. Drafts against a dense reference: ``test_spec_eagle_drafts.py``."""

from __future__ import annotations

import pytest
from eagle_engine import BATCHINGS, COMMON, GREEDY, PROMPTS, tokens
from lmkit import LLM, SamplingParams
from lmkit.errors import ConfigError
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize(("max_num_seqs", "num_blocks", "chunk"), BATCHINGS)
def test_greedy_outputs_identical_with_eagle(tiny, heads, baseline, max_num_seqs, num_blocks,
                                             chunk, proposer):
    with LLM(str(tiny), speculative=proposer, speculative_model=str(heads[proposer]),
             num_speculative_tokens=3, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
             max_num_batched_tokens=chunk, **{**COMMON, "max_model_len": 64}) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        stats = llm.stats()
    if num_blocks < 96:
        assert stats["num_preemptions"] > 0
    assert stats["spec_num_verifications"] > 0 and stats["spec_num_draft_tokens"] > 0
    assert stats["spec_mean_accepted_length"] >= 1.0
    assert {f"spec_acceptance_rate_pos_{j}" for j in range(3)} <= stats.keys()


def test_n_greater_than_one_and_opt_out(tiny, head):
    params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=16, ignore_eos=True)
    with LLM(str(tiny), num_blocks=96, **COMMON) as llm:
        base = [c.token_ids for c in llm.generate(["abcabc"], params)[0].outputs]
    with LLM(str(tiny), speculative="eagle", speculative_model=str(head), num_blocks=96,
             **COMMON) as llm:
        got = [c.token_ids for c in llm.generate(["abcabc"], params)[0].outputs]
        assert len(got) == 3 and all(len(t) == 16 for t in got)
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                             use_spec_decode=False))
        before = llm.stats()["spec_num_proposed_tokens"]
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                             use_spec_decode=False))
        assert llm.stats()["spec_num_proposed_tokens"] == before  # opted out: no drafts
    assert len(base) == 3  # (seeded samples differ with speculation; same distribution)




def test_refusals_before_weights_load(tiny, head, tmp_path, monkeypatch):
    import lmkit.loading.weights as weights

    def no_weights(*_):
        raise AssertionError("a refused head must fail before any weights load")

    monkeypatch.setattr(weights, "iterate_weights", no_weights)  # the runner's weight source
    wide = make_tiny_eagle_head(tmp_path / "wide", tiny, hidden_size=96)
    other_vocab = make_tiny_eagle_head(tmp_path / "vocab", tiny, vocab_size=512)
    cases = [
        (None, r"needs its draft head: set speculative.model"),
        (str(tmp_path / "nowhere"), r"is not an EAGLE head directory"),
        (str(wide), r"hidden_size 96 != the target's 64; fc.weight is \[96, 192\], "
                    r"expected \[96, 128\]"),
        (str(other_vocab), r"vocab_size 512 != the target's 320"),
    ]
    for model, message in cases:
        settings = {"speculative_model": model} if model else {}
        with pytest.raises(ConfigError, match=message):
            LLM(str(tiny), speculative="eagle", num_blocks=96, **settings, **COMMON)


def test_eagle3_refusals_before_weights_load(tiny, head, tmp_path, monkeypatch):
    import lmkit.loading.weights as weights

    def no_weights(*_):
        raise AssertionError("a refused head must fail before any weights load")

    monkeypatch.setattr(weights, "iterate_weights", no_weights)  # the runner's weight source
    cases = [
        (make_tiny_eagle3_head(tmp_path / "taps", tiny, layer_ids=(0, 1, 5)),
         r"target layers \[0, 1, 5\] are not all layers of the 2-layer target"),
        (make_tiny_eagle3_head(tmp_path / "fc", tiny, fc_inputs=100),
         r"fc.weight is \[64, 100\], expected \[64, 192\]"),
        (head, r"looks like an EAGLE-1/2 head .*: use --speculative eagle"),
    ]
    for model, message in cases:
        with pytest.raises(ConfigError, match=message):
            LLM(str(tiny), speculative="eagle3", speculative_model=str(model), num_blocks=96,
                **COMMON)


def _homogeneity_p_value(a, b) -> float:
    """Pearson's chi-square test that two count vectors come from one distribution
    (cells with fewer than 10 counts in both pooled)."""
    import torch

    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    small = (a + b) < 10
    a = torch.cat([a[~small], a[small].sum().reshape(1)])
    b = torch.cat([b[~small], b[small].sum().reshape(1)])
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = float(((a - ea) ** 2 / ea + (b - eb) ** 2 / eb).sum())
    df = len(a) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def test_sampled_outputs_follow_the_target_distribution(tiny, tmp_path):
    """Sampled with argmax eagle drafts (``draft_sampling: greedy``, verified by
    rejection sampling as one-hot proposals; sampled drafts: test_spec_eagle_sampling.py),
    the joint distribution of the first three tokens is the one sampled without
    speculation. The head always drafts the token the target samples most often after
    the first, so drafts are accepted often and rejected often."""
    from collections import Counter

    n = 1500
    params = [SamplingParams(temperature=0.5, seed=i, max_tokens=3, ignore_eos=True)
              for i in range(n)]

    def run(**spec):
        with LLM(str(tiny), num_blocks=500, max_num_seqs=256, **spec, **COMMON) as llm:
            counts = Counter(tuple(t) for t in tokens(llm.generate(["ab"] * n, params)))
            return counts, llm.stats()

    plain, _ = run()
    later = Counter(t for seq, c in plain.items() for t in seq[1:] for _ in range(c))
    head = make_tiny_eagle_head(tmp_path / "head", tiny,
                                constant_draft=later.most_common(1)[0][0])
    spec, stats = run(speculative="eagle", speculative_model=str(head),
                      num_speculative_tokens=2,
                      **{"speculative.options": {"draft_sampling": "greedy"}})
    assert 0.1 < stats["spec_acceptance_rate"] < 0.9, stats
    cells = sorted(plain.keys() | spec.keys())
    p = _homogeneity_p_value([plain[c] for c in cells], [spec[c] for c in cells])
    assert p > 1e-3


def test_drafts_cross_the_process_boundary(tiny, head3, baseline):
    """With the worker in its own process (executor mp), the drafts come back through
    the step codec."""
    with LLM(str(tiny), executor="mp", speculative="eagle3", speculative_model=str(head3),
             num_blocks=96, **COMMON) as llm:
        assert tokens(llm.generate(PROMPTS[:3], GREEDY)) == baseline[:3]
        assert llm.stats()["spec_num_draft_tokens"] > 0


def test_constrained_requests_get_drafts_trimmed_by_their_grammar(tiny, heads):
    """A grammar cuts the head's drafts to what it allows: constrained outputs stay the
    ones decoded without speculation."""
    pytest.importorskip("xgrammar")
    params = SamplingParams(temperature=0.0, max_tokens=24,
                            structured_outputs={"regex": "[ab]{4,20}c"})
    prompts = ["abab", "the cat"]
    with LLM(str(tiny), structured_output="auto", num_blocks=96, **COMMON) as llm:
        base = tokens(llm.generate(prompts, params))
    for proposer, head in heads.items():
        with LLM(str(tiny), structured_output="auto", speculative=proposer,
                 speculative_model=str(head), num_blocks=96, **COMMON) as llm:
            assert tokens(llm.generate(prompts, params)) == base
            stats = llm.stats()
        assert stats["spec_num_proposed_tokens"] > 0
        assert stats["grammar_drafts_trimmed"] > 0, stats


def test_pooling_requests_beside_drafting(tiny, heads, baseline):
    """Pooling requests (no next token at their last prompt position) on an engine with
    a draft head: the head skips what it cannot pair, embeddings and outputs stay exact."""
    with LLM(str(tiny), num_blocks=96, **COMMON) as llm:
        want = llm.embed(["abcabc", "the cat"])
    with LLM(str(tiny), speculative="eagle3", speculative_model=str(heads["eagle3"]),
             num_blocks=96, **COMMON) as llm:
        got = llm.embed(["abcabc", "the cat"])
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
    for a, b in zip(want, got, strict=True):
        assert a.data == pytest.approx(b.data, abs=1e-5)
