"""The penalties kernel (:mod:`lmkit_kernels.penalties`) in Triton's CPU interpreter
against the core's torch path (:func:`lmkit.sample.penalties.apply_penalties`, both its
CPU scan and its dense passes) bit for bit: penalties kept across steps in permuted
slots, rows without penalties among them, drafts (a request's rows sharing its slot)
and none, positive, negative, zero and non-finite logits, vocabularies that are not a
multiple of the block; then the ``triton`` sampling kernels through the sampler, the
switch that keeps torch, and the launcher's refusals."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu")
torch = pytest.importorskip("torch")

from lmkit.api import PenaltyRows, TorchSamplingKernels  # noqa: E402
from lmkit.api.sampling_params import SamplingParams  # noqa: E402
from lmkit.sample.draws import adjust_logits  # noqa: E402
from lmkit.sample.metadata import SamplingMetadata  # noqa: E402
from lmkit.sample.penalties import _apply_dense, _apply_scanned  # noqa: E402
from lmkit.sample.row_cache import SamplingCache  # noqa: E402
from lmkit.sample.sampler import Sampler  # noqa: E402
from lmkit.spec_decode.rows import DraftExtendedTokens  # noqa: E402
from lmkit_kernels.penalties import apply_penalties, apply_penalties_ref  # noqa: E402
from lmkit_plugins.sampling import triton_kernels  # noqa: E402
from lmkit_plugins.sampling.triton_kernels import TritonSamplingKernels  # noqa: E402

CPU = torch.device("cpu")
MIXES = [dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25),
         dict(repetition_penalty=0.7), dict(presence_penalty=-0.7),
         dict(frequency_penalty=0.3, presence_penalty=1e-3), dict(temperature=0.3),
         dict(repetition_penalty=1.1, presence_penalty=0.3, temperature=0.0), dict()]


def _kernel(logits: torch.Tensor, p: PenaltyRows) -> torch.Tensor:
    return apply_penalties(logits, p.rows, p.slots, p.counts, p.seen, p.repetition,
                           p.frequency, p.presence, p.draft_counts)


def _steps(vocab: int, seed: int, with_drafts: bool, steps: int = 4):
    """(logits, penalties) of several steps of requests that come and go (their slots
    end up out of order), every mix of parameters, drafts on some requests."""
    rng = random.Random(seed)
    cache = SamplingCache(vocab, CPU)
    live: dict[str, tuple[SamplingParams, list[int], list[int]]] = {}
    for step in range(steps):
        for rid in [r for r in live if rng.random() < 0.3]:
            cache.forget(rid)
            del live[rid]
        while len(live) < 6:
            rid = f"s{step}r{len(live)}{rng.random():.6f}"
            prompt = rng.choices(range(vocab + 3), k=rng.randrange(1, 40))  # some past vocab
            live[rid] = (SamplingParams(**rng.choice(MIXES)), prompt,
                         rng.choices(range(vocab), k=rng.randrange(0, 30)))
        keys, params, prompts, outputs = [], [], [], []
        for rid, (p, prompt, out) in live.items():
            drafts = rng.choices(range(vocab), k=rng.randrange(4)) if with_drafts else []
            for j in range(len(drafts) + 1):
                keys.append(rid)
                params.append(p)
                prompts.append(prompt)
                outputs.append(out if j == 0 else DraftExtendedTokens(out, drafts, j))
        md = SamplingMetadata.build(params, prompts, outputs, [None] * len(params),
                                    [None] * len(params), vocab, CPU, cache, keys)
        logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(
            seed * 100 + step)) * 4
        logits[:, 1::50] = float("-inf")  # banned tokens
        if md.penalties is not None:
            # exact zeros, infinities, a NaN and tiny values among a row's seen tokens
            row, tokens = md.penalties.rows[0], md.penalties.row_seen()[0].nonzero()[:, 0]
            specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"),
                                     1e-30, -1e-30])
            logits[row, tokens[:7]] = specials[:len(tokens[:7])]
            yield logits, md.penalties
        for _, _, out in live.values():
            out.extend(rng.choices(range(vocab), k=rng.randrange(1, 4)))


@pytest.mark.parametrize("with_drafts", [False, True])
@pytest.mark.parametrize("vocab", [300, 777, 1000])
def test_the_kernel_equals_the_torch_path_bit_for_bit(vocab, with_drafts):
    checked = 0
    for logits, penalties in _steps(vocab, seed=vocab + with_drafts, with_drafts=with_drafts):
        assert (penalties.draft_counts is not None) == with_drafts
        want = _apply_scanned(logits.clone(), penalties)
        assert _nan_equal(_apply_dense(logits.clone(), penalties), want)
        counts, seen = penalties.counts.clone(), penalties.seen.clone()
        got = _kernel(logits.clone(), penalties)
        assert _nan_equal(got, want)
        assert _nan_equal(apply_penalties_ref(logits.clone(), penalties.rows,
                                              penalties.slots, penalties.counts,
                                              penalties.seen, penalties.repetition,
                                              penalties.frequency, penalties.presence,
                                              penalties.draft_counts), want)
        # the kept tables are read, never written
        assert torch.equal(penalties.counts, counts) and torch.equal(penalties.seen, seen)
        assert not _nan_equal(got, logits)  # the penalties did something
        untouched = torch.ones(logits.shape[0], dtype=torch.bool)
        untouched[penalties.rows] = False
        assert _nan_equal(got[untouched], logits[untouched])  # rows without penalties
        # one and two rows: each row over several programs
        for n in (1, 2):
            few = replace(penalties, rows=penalties.rows[:n], slots=penalties.slots[:n],
                          draft_counts=None if penalties.draft_counts is None
                          else penalties.draft_counts[:n])
            assert _nan_equal(_kernel(logits.clone(), few), _apply_scanned(logits.clone(), few))
        checked += 1
    assert checked >= 3
    # the slots are not the rows' order (requests came and went)
    assert penalties.slots.tolist() != sorted(penalties.slots.tolist())


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bit for bit (the sign of a zero too), any NaN equal to any NaN
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(torch.int32)[~nan],
                                                       b.view(torch.int32)[~nan])


def test_one_row_of_hand_computed_values():
    # vocab 5: token 0 in the prompt (repetition only), 1 generated twice, 2 by a draft
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 1.0]])
    counts = torch.tensor([[0, 2, 0, 0, 0], [9, 9, 9, 9, 9]], dtype=torch.int32)
    seen = torch.tensor([[True, True, False, False, False], [True] * 5])
    one = torch.ones(1)
    got = apply_penalties(logits, torch.tensor([0]), torch.tensor([0]), counts, seen,
                          2.0 * one, 0.5 * one, 0.25 * one,
                          torch.tensor([[0, 0, 1, 0, 0]], dtype=torch.int32))
    assert got.tolist() == [[1.0, -4.0 - 1.0 - 0.25, 1.5 - 0.5 - 0.25, -1.0, 1.0]]


def _md(vocab: int, greedy: bool):
    rng = random.Random(3)
    t = 0.0 if greedy else 0.8
    params = [SamplingParams(temperature=t, **m) for m in MIXES[:4]] + [
        SamplingParams(temperature=t)]
    outputs = [rng.choices(range(vocab), k=12) for _ in params]
    return SamplingMetadata.build(params, [[1, 2, 3]] * 5, outputs, [None] * 5, [None] * 5,
                                  vocab, CPU)


@pytest.fixture
def launches(monkeypatch):
    """Counts the calls that reach the penalty kernel."""
    seen = []
    kernel = triton_kernels.triton_penalties

    def counted(*args, **kwargs):
        seen.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_kernels, "triton_penalties", counted)
    return seen


def test_the_triton_kernels_penalise_through_the_sampler_as_torch_does(launches):
    md, logits = _md(500, greedy=False), torch.randn(5, 500) * 3
    triton_kernels_ = TritonSamplingKernels(device=CPU)
    want = adjust_logits(logits.clone(), md, TorchSamplingKernels(device=CPU))
    assert torch.equal(adjust_logits(logits.clone(), md, triton_kernels_), want)
    assert len(launches) == 1
    greedy = _md(500, greedy=True)
    got = Sampler(triton_kernels_)(logits, greedy).sampled_token_ids
    assert len(launches) == 2
    assert torch.equal(got, Sampler()(logits, greedy).sampled_token_ids)


def test_the_switch_keeps_the_torch_path(launches, monkeypatch):
    monkeypatch.setenv(triton_kernels.PENALTY_KERNEL_ENV, "0")
    md, logits = _md(300, greedy=True), torch.randn(5, 300)
    want = adjust_logits(logits.clone(), md)
    assert torch.equal(adjust_logits(logits.clone(), md, TritonSamplingKernels(device=CPU)),
                       want)
    assert launches == []
    monkeypatch.setenv(triton_kernels.PENALTY_KERNEL_ENV, "maybe")
    with pytest.raises(ValueError, match="LMKIT_PENALTY_KERNEL='maybe'"):
        adjust_logits(logits.clone(), md, TritonSamplingKernels(device=CPU))


def test_wrong_arguments_are_refused_by_name():
    md = _md(64, greedy=True)
    p = md.penalties
    args = dict(rows=p.rows, slots=p.slots, counts=p.counts, seen=p.seen,
                repetition=p.repetition, frequency=p.frequency, presence=p.presence)
    logits = torch.randn(5, 64)
    cases = [
        (dict(logits=logits.half()), "logits has dtype float16; expected one of: float32"),
        (dict(logits=logits.t().contiguous().t()), "logits must have unit stride"),
        (dict(slots=p.slots[:-1]), r"slots must have shape \[4\]"),
        (dict(rows=p.rows.int()), "rows has dtype int32"),
        (dict(counts=p.counts[:, :63]), r"counts must have shape \[\*, 64\]"),
        (dict(seen=p.seen.to(torch.uint8)), "seen has dtype uint8; expected one of: bool"),
        (dict(seen=p.seen[:1]), r"seen must have shape \[\d+, 64\]"),
        (dict(presence=p.presence[:4]), r"presence must have shape \[5\]"),
        (dict(draft_counts=torch.zeros(5, 64, dtype=torch.int32)),
         r"draft_counts must have shape \[4, 64\]"),
        (dict(draft_counts=torch.zeros(4, 64)), "draft_counts has dtype float32"),
    ]
    for change, message in cases:
        kwargs = {"logits": logits.clone(), **args, **change}
        with pytest.raises(ValueError, match=message):
            apply_penalties(**kwargs)
    # no rows: nothing to do
    empty = torch.zeros(0, dtype=torch.int64)
    assert torch.equal(apply_penalties(logits.clone(), **{**args, "rows": empty,
                                                          "slots": empty}), logits)
