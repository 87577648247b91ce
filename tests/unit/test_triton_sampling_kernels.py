"""The ``triton`` sampling kernels (``lmkit_plugins.sampling``) in Triton's CPU
interpreter, through the core's :class:`~lmkit.sample.sampler.Sampler`: on the shapes
where the kernels take over they sample the torch path's distribution (chi-square over
many draws, with a control the check must reject), greedy rows stay exactly the argmax,
and seeded rows, min-p and draft distributions keep the torch path. On CUDA the engine
with these kernels is tested by tests/gpu/test_sampling_kernels_engine_gpu.py."""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter()
torch = pytest.importorskip("torch")

from lmkit.api.sampling_params import SamplingParams  # noqa: E402
from lmkit.sample.sampler import Sampler  # noqa: E402
from lmkit.testing.sampling_kernels import VOCAB, chi_square, metadata, target_probs  # noqa: E402
from lmkit_plugins.sampling import triton_kernels  # noqa: E402
from lmkit_plugins.sampling.triton_kernels import TritonSamplingKernels  # noqa: E402

CPU = torch.device("cpu")  # VOCAB (24): the nearest measured vocabulary is 49152


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls that reach the Triton kernels."""
    seen = {"sample": 0, "verify": 0}
    sample, rejection = triton_kernels.triton_sample, triton_kernels.rejection_sample

    def counted_sample(*args, **kwargs):
        seen["sample"] += 1
        return sample(*args, **kwargs)

    def counted_rejection(*args, **kwargs):
        seen["verify"] += 1
        return rejection(*args, **kwargs)

    monkeypatch.setattr(triton_kernels, "triton_sample", counted_sample)
    monkeypatch.setattr(triton_kernels, "rejection_sample", counted_rejection)
    return seen


def _sampler() -> Sampler:
    return Sampler(TritonSamplingKernels(device=CPU))


def _metadata(params: list[SamplingParams], seeds: list[int | None] | None = None):
    return metadata(params, CPU, seeds)


def _row_logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _check_sample_distribution(calls, params: SamplingParams, control: SamplingParams,
                               num_calls: int) -> None:
    torch.manual_seed(0)
    num_rows = 256  # draws per call (nearest measured batch: 256)
    logits = _row_logits().expand(num_rows, VOCAB).contiguous()
    md = _metadata([params] * num_rows)
    tokens = torch.cat([_sampler()(logits, md).sampled_token_ids for _ in range(num_calls)])
    assert calls["sample"] == num_calls
    stat, limit = chi_square(tokens, target_probs(logits[0], params))
    assert stat < limit, f"chi-square {stat:.1f} >= {limit} against the torch distribution"
    # control: the same draws against another distribution are rejected
    wrong, wrong_limit = chi_square(tokens, target_probs(logits[0], control))
    assert wrong >= wrong_limit


def test_sample_draws_the_torch_distribution_temperature(calls):
    """Temperature only at 256 rows (measured 1.07x): the kernel's race, no search."""
    _check_sample_distribution(calls, SamplingParams(temperature=0.7),
                               SamplingParams(temperature=1.5), num_calls=1)


@pytest.mark.slow
def test_sample_draws_the_torch_distribution_top_p(calls):
    """Top-p (measured 2.5x at 256 rows): the kernel's exact nucleus search."""
    _check_sample_distribution(calls, SamplingParams(temperature=1.2, top_p=0.7),
                               SamplingParams(temperature=1.2), num_calls=2)


def test_verify_emits_the_target_distribution(calls):
    """Rejection sampling of one deterministic draft per request: the first emitted token
    (the accepted draft or the recovered one) follows the target distribution."""
    torch.manual_seed(1)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    num_reqs = 256
    row = _row_logits(3)
    logits = row.expand(2 * num_reqs, VOCAB).contiguous()
    target = target_probs(row, params)
    draft = int(target.argsort(descending=True)[1])  # a likely draft, often rejected
    md = _metadata([params] * (2 * num_reqs))
    first = []
    for _ in range(2):
        out = _sampler().sample_requests(logits, md, [[draft]] * num_reqs)
        first += [ids[0] for ids in out.token_ids]
        assert all(len(ids) == n + 1 for ids, n in zip(out.token_ids, out.num_accepted,
                                                       strict=True))
    assert calls["verify"] == 2
    stat, limit = chi_square(torch.tensor(first), target)
    assert stat < limit, f"chi-square {stat:.1f} >= {limit} against the target distribution"


def test_greedy_rows_stay_exactly_the_argmax(calls):
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(5))
    logits[1, 3] = logits[1, 7] = logits[1].max() + 1  # a tie: the first index wins
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.8) for i in range(8)]
    out = _sampler()(logits, _metadata(params)).sampled_token_ids
    assert calls["sample"] == 1
    greedy = torch.arange(8) % 2 == 1
    assert torch.equal(out[greedy], logits.argmax(dim=-1)[greedy])
    assert int(out[1]) == 3
    # with drafts: a greedy request accepts exactly the drafts equal to the argmax
    rows = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(6))
    best = rows.argmax(dim=-1).tolist()
    md = _metadata([SamplingParams(temperature=0.0)] * 2 + [SamplingParams(temperature=0.9, top_p=0.8)] * 2)
    got = _sampler().sample_requests(rows, md, [[best[0]], [best[2]]])
    assert calls["verify"] == 1
    assert got.token_ids[0] == [best[0], best[1]] and got.num_accepted[0] == 1


def test_seeded_rows_keep_the_torch_path(calls):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(7))
    params = [SamplingParams(temperature=0.9, top_p=0.8)] * 4
    seeds = [None, 11, None, None]
    got = _sampler()(logits, _metadata(params, seeds)).sampled_token_ids
    want = Sampler()(logits, _metadata(params, seeds)).sampled_token_ids
    assert calls["sample"] == 0
    assert int(got[1]) == int(want[1])  # reproducible: the seed alone decides
    # with one draft per request: request 1 (rows 2 and 3) is seeded
    rows, drafts = logits.repeat(2, 1), [[1], [2], [3], [4]]
    row_seeds = [None, None, 11, 11, None, None, None, None]
    verified = _sampler().sample_requests(rows, _metadata(params * 2, row_seeds), drafts)
    again = Sampler().sample_requests(rows, _metadata(params * 2, row_seeds), drafts)
    assert calls["verify"] == 0
    assert verified.token_ids[1] == again.token_ids[1]


def test_min_p_and_draft_distributions_keep_the_torch_path(calls):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(8))
    _sampler()(logits, _metadata([SamplingParams(temperature=0.9, top_p=0.8, min_p=0.1)] * 4))
    q = torch.full((1, VOCAB), 1.0 / VOCAB)
    _sampler().sample_requests(logits, _metadata([SamplingParams(temperature=0.9)] * 4),
                               [[1], [2]], [q, q])
    assert calls == {"sample": 0, "verify": 0}


def test_shapes_the_table_gives_to_torch_keep_the_torch_path(calls):
    # temperature only at 4 rows (nearest measured: batch 1, 0.78x): torch
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(9))
    _sampler()(logits, _metadata([SamplingParams(temperature=0.9)] * 4))
    assert calls["sample"] == 0
    # top-k alone at 4 rows (0.95x): torch; verify with top-k (1.88x): the kernel
    _sampler()(logits, _metadata([SamplingParams(temperature=0.9, top_k=5)] * 4))
    assert calls["sample"] == 0
    _sampler().sample_requests(logits, _metadata([SamplingParams(temperature=0.9, top_k=5)] * 4),
                               [[1], [2]])
    assert calls["verify"] == 1


@pytest.mark.slow
def test_conformance_suite_in_the_interpreter():
    """The whole sampling-kernels suite (about 35 s interpreted)."""
    from lmkit.testing.sampling_kernels import check_sampling_kernels

    assert set(check_sampling_kernels(TritonSamplingKernels).values()) == {"passed"}


def test_device_step_kernels_and_their_switch(monkeypatch):
    """On CUDA (here: the interpreter, the switch forced) the device step's bookkeeping
    runs lmkit_kernels.spec_step and passes the conformance property against the torch
    default; LMKIT_SPEC_STEP_KERNELS=0 and the CPU keep the torch ops."""
    from lmkit.testing.sampling_kernels import check_sampling_kernels
    from lmkit_plugins.sampling.triton_kernels import spec_step_kernels

    assert spec_step_kernels("cuda") and not spec_step_kernels("cpu")
    monkeypatch.setenv("LMKIT_SPEC_STEP_KERNELS", "0")
    assert not spec_step_kernels("cuda")
    calls = []
    real_plan, real_finish = triton_kernels.plan_step, triton_kernels.finish_step
    monkeypatch.setattr(triton_kernels, "spec_step_kernels", lambda device_type: True)
    monkeypatch.setattr(triton_kernels, "plan_step",
                        lambda *a: calls.append("plan") or real_plan(*a))
    monkeypatch.setattr(triton_kernels, "finish_step",
                        lambda *a: calls.append("finish") or real_finish(*a))
    assert check_sampling_kernels(TritonSamplingKernels, only=["device step"]) == {
        "device step": "passed"}
    assert calls == ["plan", "finish"] * 3  # k = 1, 2, 4


def test_greedy_argmax_routing(monkeypatch):
    from lmkit_plugins.sampling.policy import uses_argmax_kernel

    assert uses_argmax_kernel(1, 128256, "cuda") and uses_argmax_kernel(64, 32768, "cuda")
    assert not uses_argmax_kernel(65, 128256, "cuda")  # many rows: torch's grid is fine
    assert not uses_argmax_kernel(1, 32767, "cuda") and not uses_argmax_kernel(1, 10**6, "cpu")
    taken = []
    monkeypatch.setattr(triton_kernels, "uses_argmax_kernel", lambda *shape: True)
    monkeypatch.setattr(triton_kernels, "argmax_rows",
                        lambda logits: taken.append(logits.shape) or logits.argmax(dim=-1))
    logits = torch.randn(3, VOCAB)
    kernels = TritonSamplingKernels(device=CPU)
    assert torch.equal(kernels.argmax(logits), logits.argmax(dim=-1)) and taken == [(3, VOCAB)]
    # the sampler's greedy rows go through it
    md = metadata([SamplingParams(temperature=0.0)] * 3, CPU)
    out = Sampler(kernels)(logits, md)
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert len(taken) == 2


def test_warm_up_runs_each_variant_serving_meets(monkeypatch):
    """``warm_up`` draws with every filter set the policy gives the kernel, at one row
    and at the fewest rows that take the top-p race (race on), and runs the penalties
    with and without drafts; then a real (interpreted) warm-up of a small batch runs."""
    seen = []

    def sample(logits, *, temperature, top_k, top_p, race_rounds):
        seen.append(("sample", logits.shape[0], top_k is not None, top_p is not None,
                     race_rounds))
        return torch.zeros(logits.shape[0], dtype=torch.int64)

    def penalties(logits, rows, slots, counts, seen_table, rep, freq, pres, drafts):
        assert rep.is_contiguous() and rows.shape == slots.shape == rep.shape
        seen.append(("penalties", drafts is not None))
        return logits

    with monkeypatch.context() as m:
        m.setattr(triton_kernels, "triton_sample", sample)
        m.setattr(triton_kernels, "triton_penalties", penalties)
        TritonSamplingKernels(device=CPU).warm_up(151936, 256)
    race_rows = triton_kernels._race_rows(151936, 256)
    assert race_rows is not None and race_rows > 1
    assert triton_kernels._race_rows(151936, 64) is None and triton_kernels.top_p_race_rounds(race_rows, 151936) is None
    draws = {s[1:] for s in seen if s[0] == "sample"}
    # top-p (the search at one row, the race at race_rows) and temperature at the race's
    # rows: the policy's kernel shapes; top-k alone stays torch at both
    assert (1, False, True, 0) in draws and (race_rows, False, True, None) in draws
    assert all(n in (1, race_rows) for n, *_ in draws)
    assert [s for s in seen if s[0] == "penalties"] == [("penalties", False),
                                                      ("penalties", True)]
    TritonSamplingKernels(device=CPU).warm_up(VOCAB, 4)  # the kernels themselves
