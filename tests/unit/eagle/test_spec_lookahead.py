"""Verification steps launched ahead (:mod:`lmkit.worker.spec_lookahead`), on the CPU
through the graph runners' padded path: after a step whose requests all drafted, the
runner launches the next verification before the scheduler asks for it and takes its
result when the scheduled step is that one. Every token and every draft must equal the
run without it (and the dense reference's drafts), whether the launched step is taken,
taken for a subset of its requests (others finished), or discarded (the scheduler cut
the drafts at ``max_tokens``)."""

from __future__ import annotations

import pytest
from dense_eagle import DenseEagle
from eagle_engine import (
    PROMPTS,
    lookaheads_on_the_cpu,
    padded_replays,
    run_engine,
    spec_slots_reserved,
)
from lmkit import SamplingParams
from lmkit.testing.eagle_head import make_tiny_eagle_head

# requests finish at different steps (subsets taken) and some cut their drafts at
# max_tokens (launched steps discarded)
MAX_TOKENS = [9, 14, 40, 17, 33]


def spec_lookahead_on_the_cpu(monkeypatch) -> list:
    """Let the runner build its lookaheads on the CPU; returns the spec lookaheads built."""
    from lmkit.worker.spec_lookahead import SpecLookahead

    return lookaheads_on_the_cpu(monkeypatch, SpecLookahead)


@pytest.fixture(scope="module")
def accepting(tiny, baseline, tmp_path_factory):
    """A head that always drafts the token the target's greedy outputs hold most often:
    its drafts are accepted often and rejected often."""
    from collections import Counter

    common = Counter(t for out in baseline for t in out).most_common(1)[0][0]
    return make_tiny_eagle_head(tmp_path_factory.mktemp("accepting"), tiny,
                                constant_draft=common)


def greedy(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]


def assert_reference_drafts(tiny, head, got: dict) -> None:
    reference = DenseEagle(tiny, head)
    wrong = [key for key, drafts in got.items()
             if drafts != reference.drafts(list(key[1]), len(drafts))]
    assert len(got) > 20 and not wrong, f"{len(wrong)} of {len(got)} drafts differ"


@pytest.mark.parametrize(("proposer", "k"), [("eagle", 3), ("eagle3", 3), ("accepting", 3),
                                              ("accepting", 1)])
def test_verifications_launched_ahead_change_nothing(tiny, heads, accepting, monkeypatch,
                                                     proposer, k):
    """``accepting`` with one draft per step: every draft is accepted at times, so the
    next verification reaches ``k + 1`` positions past the scheduled ones."""
    head = accepting if proposer == "accepting" else heads[proposer]
    name = "eagle" if proposer == "accepting" else proposer
    params = greedy(MAX_TOKENS)
    padded_replays(monkeypatch)
    without, plain_stats = run_engine(tiny, head, monkeypatch, PROMPTS, name, params,
                                      max_num_seqs=8, k=k)
    made = spec_lookahead_on_the_cpu(monkeypatch)
    got, stats = run_engine(tiny, head, monkeypatch, PROMPTS, name, params, max_num_seqs=8,
                            k=k)
    assert len(made) == 1
    look = made[0].stats
    assert look.used > 10 and look.discarded > 0  # taken, and cut at max_tokens
    assert look.launched >= look.used + look.discarded
    # most taken with the next drafts made on the device (accept, catch-up, drafts)
    assert look.stepped > look.used // 2 and made[0].device_step.num_steps >= look.stepped
    if proposer == "accepting":  # accepted drafts taken ahead too, several at once
        assert stats["spec_num_accepted_tokens"] > 10
        assert stats["spec_acceptance_rate"] < 0.9
    for key in ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_verifications"):
        assert stats[key] == plain_stats[key], key
    assert got == without  # same tokens (the keys) and the same drafts
    assert_reference_drafts(tiny, head, got)


def test_beside_decode_steps_launched_ahead(tiny, heads, monkeypatch):
    """With speculation off above 2 requests, large batches run plain decode steps
    launched ahead and, once the batch shrinks, verifications launched ahead."""
    params = greedy([8, 12, 40, 16, 40])
    settings = dict(max_num_seqs=8, disable_by_batch_size=2)
    padded_replays(monkeypatch)
    without, _ = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS, "eagle3", params,
                            **settings)
    made = spec_lookahead_on_the_cpu(monkeypatch)
    got, stats = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS, "eagle3", params,
                            **settings)
    assert made[0].stats.used > 5 and stats["spec_num_steps_off"] > 5
    assert got == without
    assert_reference_drafts(tiny, heads["eagle3"], got)


def test_not_launched_for_sampled_requests(tiny, heads, monkeypatch):
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(len(PROMPTS))]
    padded_replays(monkeypatch)
    made = spec_lookahead_on_the_cpu(monkeypatch)
    run_engine(tiny, heads["eagle"], monkeypatch, PROMPTS, "eagle", params, max_num_seqs=8)
    assert made[0].stats.launched == 0


@pytest.mark.parametrize(("k", "switch"), [(3, "env"), (1, "env"), (3, "config")])
def test_device_steps_switched_off(tiny, accepting, monkeypatch, k, switch):
    """``LMKIT_SPEC_DEVICE_STEP=0`` or ``speculative.device_step_max_requests: 0``:
    verifications are still launched ahead, the head's steps run from the host, and
    tokens and drafts equal the device steps' run."""
    from lmkit.worker.spec_device_step import DeviceSpecStep

    params = greedy(MAX_TOKENS)
    padded_replays(monkeypatch)
    made = spec_lookahead_on_the_cpu(monkeypatch)
    captured: list[range] = []
    capture = DeviceSpecStep.capture
    monkeypatch.setattr(DeviceSpecStep, "capture",
                        lambda self, sizes: (captured.append(sizes), capture(self, sizes)))
    stepped, _ = run_engine(tiny, accepting, monkeypatch, PROMPTS, "eagle", params,
                            max_num_seqs=8, k=k)
    assert captured == [range(1, 9)]  # the counts a step can have: max_num_seqs of 32
    off_settings = {"device_step_max_requests": 0} if switch == "config" else {}
    if switch == "env":
        monkeypatch.setenv("LMKIT_SPEC_DEVICE_STEP", "0")
    host, _ = run_engine(tiny, accepting, monkeypatch, PROMPTS, "eagle", params,
                         max_num_seqs=8, k=k, **off_settings)
    on, off = made
    assert on.stats.stepped > 10 and on.device_step is not None
    assert off.device_step is None and off.stats.stepped == 0 and off.stats.used > 10
    assert stepped == host


def test_slots_reserved_and_switch(tiny, heads, monkeypatch):
    """``2 (k + 1)`` lookahead slots with a draft head where decode steps can launch
    ahead (``k + 1`` without device steps); none with ``LMKIT_SPEC_LOOKAHEAD=0`` (and then
    no lookahead is built)."""
    import lmkit.worker.spec_lookahead as spec_lookahead

    padded_replays(monkeypatch)
    made = spec_lookahead_on_the_cpu(monkeypatch)
    slots = spec_slots_reserved(monkeypatch)
    monkeypatch.setenv("LMKIT_SPEC_LOOKAHEAD", "0")
    without, _ = run_engine(tiny, heads["eagle"], monkeypatch, PROMPTS[:2], "eagle",
                            max_num_seqs=8, k=3)
    assert made == []
    monkeypatch.delenv("LMKIT_SPEC_LOOKAHEAD")
    got, _ = run_engine(tiny, heads["eagle"], monkeypatch, PROMPTS[:2], "eagle",
                        max_num_seqs=8, k=3)
    assert len(made) == 1 and made[0].stats.used > 5
    assert got == without
    monkeypatch.setenv("LMKIT_SPEC_DEVICE_STEP", "0")
    run_engine(tiny, heads["eagle"], monkeypatch, PROMPTS[:1], "eagle", max_num_seqs=8, k=3)
    assert slots == [0, 8, 4]
    assert spec_lookahead.ENV == "LMKIT_SPEC_LOOKAHEAD"


@pytest.mark.parametrize("limit", [4, 8, None])
def test_device_steps_only_for_small_steps(tiny, accepting, monkeypatch, limit):
    """Steps of more than ``speculative.device_step_max_requests`` requests verify
    launched ahead but take the head's passes from the host; as the batch drains, device
    steps take over. At the default limit (32) all ten requests step on the device.
    Tokens and drafts equal the run without any lookahead."""
    from lmkit.worker.spec_device_step import DeviceSpecStep

    prompts = PROMPTS * 2
    params = greedy([8 + 4 * i for i in range(len(prompts))])  # the batch drains
    padded_replays(monkeypatch)
    monkeypatch.setenv("LMKIT_SPEC_LOOKAHEAD", "0")
    without, _ = run_engine(tiny, accepting, monkeypatch, prompts, "eagle", params,
                            max_num_seqs=16, k=3)
    monkeypatch.delenv("LMKIT_SPEC_LOOKAHEAD")
    made = spec_lookahead_on_the_cpu(monkeypatch)
    sizes: list[int] = []
    step = DeviceSpecStep.step

    def record(self, v, tables):
        sizes.append(v.inputs.shape[0])
        return step(self, v, tables)

    monkeypatch.setattr(DeviceSpecStep, "step", record)
    settings = {} if limit is None else {"device_step_max_requests": limit}
    got, _ = run_engine(tiny, accepting, monkeypatch, prompts, "eagle", params,
                        max_num_seqs=16, k=3, **settings)
    look = made[0].stats
    assert made[0].device_step.max_requests == (limit or 32)
    if limit is None:  # every step of the ten requests may run on the device
        assert sizes and max(sizes) > 8
    else:
        assert sizes and max(sizes) <= limit < len(prompts)
        assert look.used > look.stepped  # some taken without one
    assert look.stepped > 5
    assert got == without


@pytest.mark.parametrize("k", [1, 3])
def test_device_steps_through_the_step_kernels(tiny, accepting, monkeypatch, k):
    """A device step's bookkeeping through lmkit's two kernels (the ``triton`` sampling
    kernels' :mod:`lmkit_kernels.spec_step`, here in Triton's interpreter) instead of the
    torch ops: the same tokens and drafts, and both kernels ran every device step."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (the compiled kernels: tests/gpu)")
    pytest.importorskip("triton")
    from lmkit.api import SamplingKernels
    from lmkit.worker.spec_device_step import DeviceSpecStep
    from lmkit_kernels import spec_step

    prompts, params = PROMPTS[:3], greedy([12, 20, 26])
    padded_replays(monkeypatch)
    made = spec_lookahead_on_the_cpu(monkeypatch)
    torch_ops, _ = run_engine(tiny, accepting, monkeypatch, prompts, "eagle", params,
                              max_num_seqs=8, k=k)
    calls = {"plan": 0, "finish": 0}

    def plan(self, *args):
        calls["plan"] += 1
        return spec_step.plan_step(*args)

    def finish(self, *args):
        calls["finish"] += 1
        spec_step.finish_step(*args)

    monkeypatch.setattr(SamplingKernels, "plan_device_step", plan)
    monkeypatch.setattr(SamplingKernels, "finish_device_step", finish)
    got, _ = run_engine(tiny, accepting, monkeypatch, prompts, "eagle", params,
                        max_num_seqs=8, k=k)
    step = made[-1].device_step
    assert isinstance(step, DeviceSpecStep)
    assert made[-1].stats.stepped > 5  # device steps taken (some queued ones discarded)
    assert calls == {"plan": step.num_steps, "finish": step.num_steps}
    assert got == torch_ops


def test_launched_verifications_take_the_sampling_kernels_argmax(tiny, accepting, monkeypatch):
    """A launched verification's greedy targets (and a device step's next ones) are the
    engine's sampling kernels' argmax (:meth:`lmkit.api.SamplingKernels.argmax`, which
    a plugin may replace), not a private torch reduction: one call per launch and per
    device step, and the same tokens and drafts as the run without the lookahead."""
    import sys
    from collections import Counter

    from lmkit.api import SamplingKernels

    prompts, params = PROMPTS[:3], greedy([12, 20, 26])
    padded_replays(monkeypatch)
    without, _ = run_engine(tiny, accepting, monkeypatch, prompts, "eagle", params,
                            max_num_seqs=8, k=3)
    made = spec_lookahead_on_the_cpu(monkeypatch)
    calls = []
    original = SamplingKernels.argmax

    def argmax(self, logits):
        calls.append((sys._getframe(1).f_code.co_name, logits.shape[0]))
        return original(self, logits)

    monkeypatch.setattr(SamplingKernels, "argmax", argmax)
    got, _ = run_engine(tiny, accepting, monkeypatch, prompts, "eagle", params,
                        max_num_seqs=8, k=3)
    look = made[-1]
    sites = Counter(site for site, _ in calls)
    # launched from the host, and queued by each device step (its next verification)
    assert sites["_launch"] > 5 and sites["verify"] == look.device_step.num_steps > 5
    assert set(sites) == {"_launch", "verify"}
    assert all(rows % 4 == 0 for _, rows in calls)  # 1 + k rows per request
    assert got == without
