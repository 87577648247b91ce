"""``--speculative eagle`` on the tiny random Llama with a random EAGLE head
(:mod:`lmkit.testing.eagle_head`): lossless greedy outputs across batch sizes, prefix
caching and preemption; drafts that do not depend on how the steps were cut (batching,
chunked prefill, preemption: the head's KV is caught up exactly); acceptance counters;
refusals before any weights load."""

from __future__ import annotations

import pytest
from dense_eagle import DenseEagle
from lmkit import LLM, SamplingParams
from lmkit.api import LMKitConfig
from lmkit.api.request import Request
from lmkit.errors import ConfigError
from lmkit.plugin_host.manager import PluginHost
from lmkit.spec_decode.manager import ProposerManager
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head
from lmkit.testing.tiny_model import make_tiny_model

COMMON = dict(device="cpu", dtype="float32", max_model_len=256, block_size=4)
PROMPTS = ["abcabcabcabc", "the cat sat on the mat; the cat", "x", "0123401234",
           "abcabcabcabc"]  # the last one hits the prefix cache of the first
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-eagle"))


@pytest.fixture(scope="module")
def head(tiny, tmp_path_factory):
    # weights large enough that the drafts depend on the head's attention (its KV cache)
    return make_tiny_eagle_head(tmp_path_factory.mktemp("eagle-head"), tiny, layer_std=0.3)


@pytest.fixture(scope="module")
def head3(tiny, tmp_path_factory):
    return make_tiny_eagle3_head(tmp_path_factory.mktemp("eagle3-head"), tiny)


@pytest.fixture(scope="module")
def heads(head, head3):
    return {"eagle": head, "eagle3": head3}


@pytest.fixture(scope="module")
def baseline(tiny):
    with LLM(str(tiny), num_blocks=96, **COMMON) as llm:
        return _tokens(llm.generate(PROMPTS, GREEDY))


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize(("max_num_seqs", "num_blocks", "chunk"), [
    (1, 96, 512),  # one request at a time
    (8, 96, 512),  # the whole batch, prefix-cache hits
    (8, 20, 16),  # a small KV pool (preemptions) and chunked prefill
])
def test_greedy_outputs_identical_with_eagle(tiny, heads, baseline, max_num_seqs, num_blocks,
                                             chunk, proposer):
    with LLM(str(tiny), speculative=proposer, speculative_model=str(heads[proposer]),
             num_speculative_tokens=3, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
             max_num_batched_tokens=chunk, **{**COMMON, "max_model_len": 64}) as llm:
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == baseline
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


def _run_engine(tiny, head, monkeypatch, prompts, proposer="eagle", params=None, **settings):
    """Run ``prompts`` greedily in an in-process engine; return what the head drafted
    for each request at each length: ``{(prompt index, tokens so far): drafts}``."""
    from lmkit.engine.core import EngineCore

    seen: dict[tuple[int, int], list[int]] = {}
    take = ProposerManager.take_runner_drafts

    def record(self, requests, drafts):
        for r in requests:
            if r.request_id in drafts:
                seen[(int(r.request_id), tuple(r.all_token_ids))] = list(drafts[r.request_id])
        return take(self, requests, drafts)

    monkeypatch.setattr(ProposerManager, "take_runner_drafts", record)
    config = LMKitConfig.model_validate({
        "model": {"model": str(tiny), "dtype": "float32", "max_model_len": 64},
        "attention": {"backend": "torch"}, "executor": {"device": "cpu"},
        "cache": {"block_size": 4, "num_blocks": settings.pop("num_blocks", 96)},
        "speculative": {"backend": proposer, "model": str(head), "num_speculative_tokens": 3,
                        "disable_by_batch_size": settings.pop("disable_by_batch_size", None)},
        "scheduler": settings})
    core = EngineCore(config, PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}),
                      progress=False)
    try:
        tok = core.facts
        for i, prompt in enumerate(prompts):
            core.add_request(Request(str(i), list(prompt.encode()),
                                     GREEDY if params is None else params[i],
                                     eos_token_id=tok.eos_token_id))
        while core.has_unfinished_requests():
            core.step()
        stats = core.stats()
    finally:
        core.shutdown()
    return seen, stats


def _padded_replays(monkeypatch):
    """Make the runner verify, and the head catch up and draft, through the graph
    runners' padded, fixed-buffer forwards on the CPU (``use_graphs=False``: the graph
    path without capture), the padding rows' cache writes (slot -1) sent to the null
    block 0. Returns the target's graph runners and the draft runners (their
    ``graphs`` and ``catch_up_graphs`` count the passes replayed)."""
    import lmkit.worker.model_runner as model_runner
    from lmkit.worker.cuda_graphs import CudaGraphRunner
    from lmkit.worker.draft_runner import DraftRunner
    from lmkit_plugins.attention.torch_ref import TorchAttention

    made: list[CudaGraphRunner] = []
    drafters: list[DraftRunner] = []
    plan, capture_graphs = TorchAttention.plan, DraftRunner.capture_graphs

    def plan_scratch_padding(self, metadata):
        plan(self, metadata)
        self._plan.slot_mapping = self._plan.slot_mapping.clamp(min=0)

    def record_drafter(self, *args):
        capture_graphs(self, *args)
        drafters.append(self)

    def capture(config, stack, model, kv_caches, device, max_model_len, aux_layers=()):
        made.append(CudaGraphRunner(
            model, kv_caches, device, config.scheduler.max_num_seqs, max_model_len,
            config.cache.block_size, use_graphs=False,
            max_query_len=1 + config.speculative.num_speculative_tokens, aux_layers=aux_layers))
        return made[-1]

    monkeypatch.setattr(TorchAttention, "plan", plan_scratch_padding)
    monkeypatch.setattr(DraftRunner, "capture_graphs", record_drafter)
    monkeypatch.setattr(model_runner, "maybe_capture", capture)
    return made, drafters


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize("settings", [
    {"max_num_seqs": 8},  # whole prompts, then verification steps
    {"max_num_seqs": 2, "max_num_batched_tokens": 8},  # prompt chunks beside verification
], ids=["batch-8", "small-chunks"])
def test_drafts_equal_a_dense_reference_through_graph_replays(tiny, heads, monkeypatch,
                                                              proposer, settings):
    """Verification steps replayed through the decode graphs (flattened) hand the head
    the same features as eager steps (EAGLE-3's target-layer inputs come out of the
    graphs too); the head's catch-up passes after them replay padded, flattened passes
    (one row per kept position: prompt chunks of at most 1 + k tokens too) and its draft
    passes padded passes of their own: the drafts still equal the dense reference."""
    runners, drafters = _padded_replays(monkeypatch)
    got, _ = _run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, **settings)
    assert runners and runners[0].num_flattened_replays > 5
    drafter = drafters[0]
    assert drafter.graphs is not None and drafter.graphs.num_passes > 20  # k - 1 passes
    catch_up = drafter.catch_up_graphs
    assert catch_up is not None and catch_up.width == 64 * (1 if proposer == "eagle" else 3)
    assert catch_up.num_passes > 20
    if "max_num_batched_tokens" in settings:
        assert drafter.num_flattened_catch_ups > 0
    assert drafter.num_eager_catch_ups > 0  # prompts catch up eagerly
    assert runners[0].aux_layers == (() if proposer == "eagle" else (0, 1, 1))
    reference = DenseEagle(tiny, heads[proposer])
    wrong = [key for key, drafts in got.items()
             if drafts != reference.drafts(list(key[1]), len(drafts))]
    assert len(got) > 20 and not wrong, f"{len(wrong)} of {len(got)} drafts differ"


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize("mode", ["in-graph", "broken-feed", "eager-argmax"])
def test_draft_passes_take_their_drafts_in_the_replay(tiny, heads, monkeypatch, proposer,
                                                      mode):
    """The draft passes' graphs take each pass's greedy drafts themselves and feed them
    (and the head's output) to the next pass on the device, and the catch-up pass's
    graphs take the first drafts: every replayed pass takes its drafts inside the
    replay (the eager argmax runs only after eager catch-ups), and the drafts equal the
    dense reference. A feed that hands the next pass wrong ids is caught by that
    comparison; a head without ``supports_graph_drafts`` takes them eagerly after each
    replay, with the same drafts."""
    from lmkit.worker.draft_graphs import HeadPass
    from lmkit.worker.draft_runner import DraftRunner
    from lmkit_plugins.spec.eagle import EagleProposer
    from lmkit_plugins.spec.eagle3 import Eagle3Proposer

    cls = {"eagle": EagleProposer, "eagle3": Eagle3Proposer}[proposer]
    if mode == "eager-argmax":
        monkeypatch.setattr(cls, "supports_graph_drafts", False)
    calls = {"argmax": 0, "in_graph": 0, "drafting_steps": 0}
    draft_argmax, call, propose = cls.draft_argmax, HeadPass.__call__, DraftRunner.propose

    def counted_argmax(self, hidden):
        calls["argmax"] += 1
        return draft_argmax(self, hidden)

    def head_pass(self, input_ids, positions, ctx):
        hidden = call(self, input_ids, positions, ctx)
        if self.drafts:
            calls["in_graph"] += 1
            if mode == "broken-feed":  # hand the next pass the wrong ids
                self.feed_ids[:len(input_ids)].add_(1).remainder_(256)
        return hidden

    def counted_propose(self, *args):
        out = propose(self, *args)
        calls["drafting_steps"] += bool(out)
        return out

    monkeypatch.setattr(cls, "draft_argmax", counted_argmax)
    monkeypatch.setattr(HeadPass, "__call__", head_pass)
    monkeypatch.setattr(DraftRunner, "propose", counted_propose)
    _, drafters = _padded_replays(monkeypatch)
    got, _ = _run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                         max_num_seqs=8)
    graphs, catch_up = drafters[0].graphs, drafters[0].catch_up_graphs
    assert graphs is not None and graphs.num_passes > 20
    assert catch_up is not None and catch_up.num_passes > 20
    reference = DenseEagle(tiny, heads[proposer])
    wrong = [key for key, drafts in got.items()
             if drafts != reference.drafts(list(key[1]), len(drafts))]
    if mode == "broken-feed":
        assert len(wrong) > len(got) // 2, "a broken feed went unnoticed"
        return
    assert len(got) > 20 and not wrong, f"{len(wrong)} of {len(got)} drafts differ"
    if mode == "in-graph":
        assert graphs.drafts_in_graph and catch_up.drafts_in_graph
        assert calls["in_graph"] == graphs.num_passes + catch_up.num_passes
        eager = calls["argmax"] - calls["in_graph"]  # first drafts after eager catch-ups
        assert 0 < eager <= drafters[0].num_eager_catch_ups < calls["drafting_steps"]
    else:
        assert not graphs.drafts_in_graph and calls["in_graph"] == 0
        assert calls["argmax"] == graphs.num_passes + calls["drafting_steps"]


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize("settings", [
    {"max_num_seqs": 1},  # one request at a time, whole prompts
    {"max_num_seqs": 8, "max_num_batched_tokens": 16, "num_blocks": 20},  # chunked, preempted
], ids=["one-at-a-time", "chunked-preempted"])
def test_drafts_equal_a_dense_reference(tiny, heads, monkeypatch, settings, proposer):
    """Every draft the paged head made equals the head run densely (no KV cache, whole
    sequences) over the target's hidden states (EAGLE-3: its chosen layers' inputs): the
    head's KV was caught up exactly, whatever the batching, chunking, prefix-cache hits
    and preemptions."""
    got, stats = _run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                             **settings)
    if "num_blocks" in settings:
        assert stats["num_preemptions"] > 0
    assert len(got) > 20
    reference = DenseEagle(tiny, heads[proposer])
    wrong = {key: (drafts, reference.drafts(list(key[1]), len(drafts)))
             for key, drafts in got.items()}
    wrong = {key: pair for key, pair in wrong.items() if pair[0] != pair[1]}
    assert not wrong, f"{len(wrong)} of {len(got)} drafts differ, e.g. {next(iter(wrong.values()))}"


def test_no_draft_passes_after_large_steps(tiny, head, baseline, monkeypatch):
    """With speculative.disable_by_batch_size, a step that ran more requests than that
    skips the draft passes (the head still catches up: later drafts stay exact)."""
    from lmkit.worker.draft_runner import DraftRunner

    drafted = []
    propose = DraftRunner.propose

    def record(self, features, step, num_kept, drafting):
        drafted.append((step.num_reqs, bool(drafting.any())))
        return propose(self, features, step, num_kept, drafting)

    monkeypatch.setattr(DraftRunner, "propose", record)
    params = [SamplingParams(temperature=0.0, max_tokens=6 * (i + 1), ignore_eos=True)
              for i in range(len(PROMPTS))]  # fewer requests run as they finish
    got, _ = _run_engine(tiny, head, monkeypatch, PROMPTS, params=params, max_num_seqs=8,
                         disable_by_batch_size=2)
    assert any(n > 2 for n, _ in drafted)
    assert all(not d for n, d in drafted if n > 2) and any(d for n, d in drafted if n <= 2)
    reference = DenseEagle(tiny, head)
    assert all(d == reference.drafts(list(key[1]), len(d)) for key, d in got.items())


def test_refusals_before_weights_load(tiny, head, tmp_path, monkeypatch):
    import lmkit.worker.model_runner as runner

    def no_weights(*_):
        raise AssertionError("a refused head must fail before any weights load")

    monkeypatch.setattr(runner, "iterate_weights", no_weights)
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
    import lmkit.worker.model_runner as runner

    def no_weights(*_):
        raise AssertionError("a refused head must fail before any weights load")

    monkeypatch.setattr(runner, "iterate_weights", no_weights)
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


def test_features_not_built_yet_are_refused(tiny, head):
    with pytest.raises(ConfigError, match=r"KV offload tier .*not built yet"):
        LLM(str(tiny), speculative="eagle", speculative_model=str(head), offload="cpu",
            num_blocks=96, **COMMON)


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
    """Sampled with eagle drafts (verified by rejection sampling as one-hot proposals),
    the joint distribution of the first three tokens is the one sampled without
    speculation. The head always drafts the token the target samples most often after
    the first, so drafts are accepted often and rejected often."""
    from collections import Counter

    n = 1500
    params = [SamplingParams(temperature=0.5, seed=i, max_tokens=3, ignore_eos=True)
              for i in range(n)]

    def run(**spec):
        with LLM(str(tiny), num_blocks=500, max_num_seqs=256, **spec, **COMMON) as llm:
            counts = Counter(tuple(t) for t in _tokens(llm.generate(["ab"] * n, params)))
            return counts, llm.stats()

    plain, _ = run()
    later = Counter(t for seq, c in plain.items() for t in seq[1:] for _ in range(c))
    head = make_tiny_eagle_head(tmp_path / "head", tiny,
                                constant_draft=later.most_common(1)[0][0])
    spec, stats = run(speculative="eagle", speculative_model=str(head),
                      num_speculative_tokens=2)
    assert 0.1 < stats["spec_acceptance_rate"] < 0.9, stats
    cells = sorted(plain.keys() | spec.keys())
    p = _homogeneity_p_value([plain[c] for c in cells], [spec[c] for c in cells])
    assert p > 1e-3


def test_drafts_cross_the_process_boundary(tiny, head3, baseline):
    """With the worker in its own process (executor mp), the drafts come back through
    the step codec."""
    with LLM(str(tiny), executor="mp", speculative="eagle3", speculative_model=str(head3),
             num_blocks=96, **COMMON) as llm:
        assert _tokens(llm.generate(PROMPTS[:3], GREEDY)) == baseline[:3]
        assert llm.stats()["spec_num_draft_tokens"] > 0


def test_constrained_requests_get_drafts_trimmed_by_their_grammar(tiny, heads):
    """A grammar cuts the head's drafts to what it allows: constrained outputs stay the
    ones decoded without speculation."""
    pytest.importorskip("xgrammar")
    params = SamplingParams(temperature=0.0, max_tokens=24,
                            structured_outputs={"regex": "[ab]{4,20}c"})
    prompts = ["abab", "the cat"]
    with LLM(str(tiny), structured_output="auto", num_blocks=96, **COMMON) as llm:
        base = _tokens(llm.generate(prompts, params))
    for proposer, head in heads.items():
        with LLM(str(tiny), structured_output="auto", speculative=proposer,
                 speculative_model=str(head), num_blocks=96, **COMMON) as llm:
            assert _tokens(llm.generate(prompts, params)) == base
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
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == baseline
    for a, b in zip(want, got, strict=True):
        assert a.data == pytest.approx(b.data, abs=1e-5)
