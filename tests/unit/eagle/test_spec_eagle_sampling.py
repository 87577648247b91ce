"""Sampled drafts of the EAGLE proposers (``draft_sampling: auto``, the default): requests
with temperature > 0 draw their drafts from the head's filtered distribution and
verification gets those distributions. Outputs keep the target's distribution (chi-square
against plain sampling), greedy requests keep their argmax drafts and outputs, seeded
requests stay reproducible, a head whose distribution is the target's gets nearly every
sampled draft accepted (far more than its argmax drafts), and the option refuses values it
does not know."""

from __future__ import annotations

from collections import Counter

import pytest
from dense_eagle import DenseEagle
from eagle_engine import COMMON, GREEDY, PROMPTS, padded_replays, run_engine, tokens
from lmkit import LLM, SamplingParams
from lmkit.errors import ConfigError
from test_spec_eagle import _homogeneity_p_value


def _count_probs(monkeypatch) -> Counter:
    """Count, per verification, the requests verified against sampled draft
    distributions (``probs``) and those verified as one-hot (``one_hot``)."""
    from lmkit.worker.draft_runner import DraftRunner

    seen: Counter = Counter()
    take = DraftRunner.take_probs

    def counted(self, req_ids, drafts):
        out = take(self, req_ids, drafts)
        got = out if out is not None else [None] * len(req_ids)
        for p, d in zip(got, drafts, strict=True):
            if d:
                seen["probs" if p is not None else "one_hot"] += 1
                if p is not None:
                    assert p.shape == (len(d), 320)
                    assert p.sum(dim=1).sub(1).abs().max() < 1e-4
                    assert bool((p[range(len(d)), list(d)] > 0).all())  # drawn from p
        return out

    monkeypatch.setattr(DraftRunner, "take_probs", counted)
    return seen


def _spec(proposer, head, draft_sampling="auto"):
    return {"speculative": proposer, "speculative_model": str(head),
            "speculative.options": {"draft_sampling": draft_sampling}}


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_sampled_drafts_keep_the_target_distribution(tiny, heads, tmp_path, monkeypatch,
                                                     proposer):
    """The joint distribution of the first three sampled tokens with sampled drafts
    (temperature, top-k, top-p applied to the head) is the one sampled without
    speculation. EAGLE: a noisy copy of a head equal to the target, so drafts are
    accepted often and rejected often; EAGLE-3: the random head, drafting over its
    200-token draft vocabulary (mapped by d2t)."""
    n = 1500
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=i, max_tokens=3,
                             ignore_eos=True) for i in range(n)]
    target, head = ((tiny, heads["eagle3"]) if proposer == "eagle3"
                    else _target_equal_pair(tiny, tmp_path, noise=1.0))

    def run(**spec):
        with LLM(str(target), num_blocks=500, max_num_seqs=256, **spec, **COMMON) as llm:
            counts = Counter(tuple(t) for t in tokens(llm.generate(["ab"] * n, params)))
            return counts, llm.stats()

    seen = _count_probs(monkeypatch)
    plain, _ = run()
    spec, stats = run(**_spec(proposer, head), num_speculative_tokens=2)
    assert seen["probs"] > n // 2 and seen["one_hot"] == 0, seen
    rate = stats["spec_acceptance_rate"]
    assert (0.2 < rate < 0.9) if proposer == "eagle" else rate > 0, rate
    cells = sorted(plain.keys() | spec.keys())
    assert _homogeneity_p_value([plain[c] for c in cells], [spec[c] for c in cells]) > 1e-3


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_greedy_requests_keep_argmax_drafts_beside_sampled_ones(tiny, heads, baseline,
                                                                monkeypatch, proposer,
                                                                max_num_seqs):
    """Greedy requests batched with sampled ones (whose passes sample) still draft the
    head's argmax (the dense reference) and decode exactly as without speculation."""
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=32, ignore_eos=True)
    params = [GREEDY if i % 2 == 0 else sampled for i in range(len(PROMPTS))]
    seen = _count_probs(monkeypatch)
    got, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, params=params,
                        max_num_seqs=max_num_seqs)
    greedy = {key: d for key, d in got.items() if int(key[0]) % 2 == 0}
    reference = DenseEagle(tiny, heads[proposer])
    assert len(greedy) > 10
    assert all(d == reference.drafts(list(key[1]), len(d)) for key, d in greedy.items())
    assert seen["probs"] > 0  # the sampled requests' drafts were verified against q
    with LLM(str(tiny), num_blocks=96, max_num_seqs=max_num_seqs,
             **_spec(proposer, heads[proposer]), **{**COMMON, "max_model_len": 64}) as llm:
        outs = tokens(llm.generate(PROMPTS, params))
    assert [o for i, o in enumerate(outs) if i % 2 == 0] == baseline[0::2]


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize("flat_tokens", [0, 64], ids=["prompts-eager", "prompts-flattened"])
def test_sampled_drafts_in_padded_graph_passes_equal_eager_ones(tiny, heads, monkeypatch,
                                                                proposer, flat_tokens):
    """The sampling draft passes and catch-up passes (the graphs' padded, fixed-buffer
    forwards, uncaptured on the CPU: parameters and uniforms in buffers, drafts and
    candidates taken inside the pass) draft what eager passes draft, for seeded
    requests; a greedy request beside them replays the same passes. With short steps
    flattened (``flat_tokens``) the catch-up over the prompts samples the first drafts
    in the catch-up graphs too (no eager catch-up at all)."""
    params = [SamplingParams(temperature=1.5, top_p=0.95, top_k=60, seed=10 + i,
                             max_tokens=32, ignore_eos=True) for i in range(len(PROMPTS))]
    params[2] = GREEDY
    eager, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                          params=params, max_num_seqs=8)
    _, drafters = padded_replays(monkeypatch, flat_tokens=flat_tokens)
    padded, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                           params=params, max_num_seqs=8)
    assert (drafters[0].num_eager_catch_ups == 0) == (flat_tokens > 0)
    graphs, catch_up = drafters[0].sampled_graphs, drafters[0].sampled_catch_up_graphs
    assert graphs is not None and graphs.samples_in_graph and graphs.num_passes > 10
    assert catch_up is not None and catch_up.samples_in_graph and catch_up.num_passes > 10
    assert drafters[0].num_sampled_steps > 10
    assert len(eager) > 20
    if not flat_tokens:
        assert padded == eager
        return
    # the prompts' K/V from decode rows round otherwise than the eager prefill's, so a
    # seeded request's samples may part ways after a while: every context both runs
    # reached must have the same drafts, and most contexts are reached by both
    both = [key for key in eager if key in padded]
    assert len(both) >= 0.8 * len(eager)
    assert all(padded[key] == eager[key] for key in both)


def test_seeded_sampled_requests_are_reproducible(tiny, heads):
    """A seeded request's drafts draw from its own generator: the same outputs in two
    engines, alone or beside unseeded requests."""
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24,
                            ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    runs = []
    for prompts, params in ((["abcab"], [seeded]),
                            (["abcab", "xyz", "the cat"], [seeded, other, other]),
                            (["abcab"], [seeded])):
        with LLM(str(tiny), num_blocks=96, **_spec("eagle3", heads["eagle3"]),
                 **COMMON) as llm:
            runs.append(tokens(llm.generate(prompts, params))[0])
    assert runs[0] == runs[1] == runs[2]


def _target_equal_pair(tiny, tmp_path, noise=0.0):
    """A target whose next-token distribution depends on the last token only (its layers
    add nothing; embedding rows and final norm scaled so the norm is the identity) and an
    EAGLE head whose distribution is exactly the target's next one (``fc`` passes the
    next token's embedding through, its layer adds nothing, the target's LM head); with
    ``noise``, ``fc`` is perturbed by that much (a head close to the target)."""
    import shutil

    import torch
    from lmkit.testing.eagle_head import make_tiny_eagle_head
    from safetensors.torch import load_file, save_file

    target = tmp_path / f"last-token-target-{noise}"
    shutil.copytree(tiny, target)
    w = load_file(target / "model.safetensors")
    rms = 0.25  # the token's own logit 64 * rms**2 = 4, the others' spread 8 * rms**2
    emb = w["model.embed_tokens.weight"]
    scale = rms / emb.pow(2).mean(dim=1, keepdim=True).sqrt().clamp_min(1e-6)  # 0: padding
    w["model.embed_tokens.weight"] = emb * scale
    w["model.norm.weight"] = torch.full_like(w["model.norm.weight"], rms)
    for name in list(w):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    save_file(w, target / "model.safetensors")
    head = make_tiny_eagle_head(tmp_path / f"equal-head-{noise}", target)
    hw = load_file(head / "model.safetensors")
    h = hw["fc.bias"].shape[0]
    fc = torch.eye(h) + noise * torch.randn(h, h, generator=torch.Generator().manual_seed(0)) / h**0.5
    hw["fc.weight"] = torch.cat([fc, torch.zeros(h, h)], dim=1)
    hw["fc.bias"] = torch.zeros(h)
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        hw[name] = torch.zeros_like(hw[name])
    save_file(hw, head / "model.safetensors")
    return target, head


def test_sampled_drafts_of_a_head_equal_to_the_target_are_all_accepted(tiny, tmp_path):
    """With the head's distribution equal to the target's, every sampled draft passes
    ``u < p / q = 1``; argmax drafts pass only with the target's probability of them."""
    target, head = _target_equal_pair(tiny, tmp_path)
    params = SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=48, ignore_eos=True)
    rates = {}
    for mode in ("auto", "greedy"):
        with LLM(str(target), num_blocks=96, num_speculative_tokens=3,
                 **_spec("eagle", head, mode), **COMMON) as llm:
            llm.generate(PROMPTS, params)
            rates[mode] = llm.stats()["spec_acceptance_rate"]
    assert rates["auto"] > 0.99, rates
    assert rates["greedy"] < 0.6, rates


def test_draft_sampling_option_is_validated(tiny, heads):
    with pytest.raises(ConfigError, match=r"speculative.options.draft_sampling: Input should "
                                          r"be 'auto' or 'greedy' \(got 'sometimes'\)"):
        LLM(str(tiny), num_blocks=96, **_spec("eagle", heads["eagle"], "sometimes"), **COMMON)


@pytest.mark.slow
def test_sampled_drafts_with_the_worker_in_its_own_process(tiny, heads):
    """The draft distributions stay in the worker (executor mp): seeded sampled outputs
    are those of the in-process engine."""
    params = [SamplingParams(temperature=1.0, top_k=40, seed=40 + i, max_tokens=16,
                             ignore_eos=True) for i in range(3)]
    outs = []
    for executor in ("mp", None):
        settings = {"executor": executor} if executor else {}
        with LLM(str(tiny), num_blocks=96, **_spec("eagle3", heads["eagle3"]), **settings,
                 **COMMON) as llm:
            outs.append(tokens(llm.generate(PROMPTS[:3], params)))
            assert llm.stats()["spec_num_draft_tokens"] > 0
    assert outs[0] == outs[1]
