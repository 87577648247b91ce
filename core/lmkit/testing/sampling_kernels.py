"""Conformance suite for sampling kernels (:class:`lmkit.api.SamplingKernels`).

The kernels are built as ``cls(*, device, options)`` and given steps of identical rows
(so one call makes many draws of one distribution) on a 24-token vocabulary.
Properties:

* ``sample distribution``: draws of ``sample`` follow the torch path's distribution
  (:func:`lmkit.sample.filters.logits_to_probs`) for temperature, top-k, top-p, top-k
  with top-p, and min-p rows, and for the random rows of a batch mixed with greedy
  ones (chi-square at the 99.9% level; tokens the distribution excludes never drawn);
* ``seeded rows``: rows with their own generator draw exactly what the core's torch
  kernels draw with the same seeds, whatever the other rows are;
* ``verify distribution``: with one deterministic draft per request, the first token
  emitted (the accepted draft, or the row's recovered draw) follows the target;
* ``verify seeded``: seeded requests verify exactly as with the torch kernels;
* ``device step``: ``plan_device_step`` and ``finish_device_step`` (plugin API 1.4) give
  the torch defaults' integers exactly, for one to four drafts and every accepted count;
* ``penalties``: ``apply_penalties`` (plugin API 1.7) gives the torch default's logits
  bit for bit: repetition, frequency and presence on rows out of slot order, a row
  without penalties, drafts counted for one row alone, positive, negative and zero
  logits; the kept tables are not written.

Use :func:`check_sampling_kernels`, or subclass :class:`SamplingKernelsConformance` and
define a ``sampling_kernels`` fixture returning the spec or class (set ``device`` on the
class to test on another device).
"""

from __future__ import annotations

from typing import Any

from lmkit.testing.failure import (
    CONSTRUCTOR_PROPERTY,
    Target,
    resolve_target,
    run_checks,
    skip_if_not_applicable,
)

SUITE = "sampling kernels"
VOCAB = 24
NUM_ROWS = 256
# 99.9% quantiles of chi-square with 1..24 degrees of freedom
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26,
            32.91, 34.53, 36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31, 46.80, 48.27,
            49.73, 51.18]
# name -> SamplingParams keyword arguments of the rows sampled
PARAMS: dict[str, dict[str, Any]] = {
    "temperature 0.7": {"temperature": 0.7},
    "top-k 5": {"temperature": 1.0, "top_k": 5},
    "top-p 0.7": {"temperature": 1.2, "top_p": 0.7},
    "top-k 8, top-p 0.8": {"temperature": 0.9, "top_k": 8, "top_p": 0.8},
    "min-p 0.1": {"temperature": 1.0, "min_p": 0.1},
}


def chi_square(tokens: Any, probs: Any) -> tuple[float, float]:
    """(statistic, its 99.9% quantile) of the draws ``tokens`` (int64 ``[n]``) against
    ``probs`` (``[vocab]``), tokens expected fewer than 5 times pooled into one bin; a
    draw of a zero-probability token gives ``inf``."""
    import torch

    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    expected = probs.cpu().double() * tokens.numel()
    if bool((counts[expected == 0] > 0).any()):
        return float("inf"), 0.0
    big = expected >= 5
    counts = torch.cat([counts[big], counts[~big].sum().view(1)])
    expected = torch.cat([expected[big], expected[~big].sum().view(1)])
    kept = expected > 0
    stat = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    return stat, CHI2_999[max(int(kept.sum()) - 2, 0)]


def metadata(params: list[Any], device: Any, seeds: list[int | None] | None = None) -> Any:
    """:class:`~lmkit.sample.metadata.SamplingMetadata` of one row per ``params``."""
    from lmkit.sample.draws import make_generator
    from lmkit.sample.metadata import SamplingMetadata

    n = len(params)
    gens = [None if s is None else make_generator(s, device) for s in (seeds or [None] * n)]
    return SamplingMetadata.build(params, [[1]] * n, [[]] * n, gens, [None] * n, VOCAB, device)


def target_probs(logits: Any, params: Any) -> Any:
    """The torch path's distribution ``[vocab]`` for one row of ``logits`` with ``params``."""
    from lmkit.sample.filters import logits_to_probs

    md = metadata([params], logits.device)
    return logits_to_probs(logits.float().clone().view(1, -1), md.temperature, md.top_k,
                           md.top_p, md.min_p, md.max_top_k)[0]


class _Suite:
    def __init__(self, t: Target, device: str) -> None:
        import torch

        self.t, self.torch = t, torch
        self.device = torch.device(device)
        self.kernels = t.build(SUITE, "sampling_kernels", "construction", f"device {device}",
                               device=self.device, options=t.options)
        self.row = (torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 2
                    ).to(self.device)

    def _check(self, prop: str, input: str, tokens: Any, probs: Any) -> None:
        stat, limit = chi_square(tokens, probs)
        if not stat < limit:
            raise self.t.fail(SUITE, prop, input,
                              f"chi-square {stat:.1f} >= {limit} ({tokens.numel()} draws): "
                              "the draws do not follow the torch path's distribution "
                              f"{[round(float(p), 3) for p in probs]}")

    def sample_distribution(self) -> None:
        from lmkit.api.sampling_params import SamplingParams
        from lmkit.sample.kernels import random_rows

        torch = self.torch
        torch.manual_seed(0)
        logits = self.row.expand(NUM_ROWS, VOCAB).contiguous()
        for name, kwargs in PARAMS.items():
            params = SamplingParams(**kwargs)
            md = metadata([params] * NUM_ROWS, self.device)
            tokens = self.kernels.sample(logits.clone(), random_rows(md))
            self._check("sample distribution", f"{NUM_ROWS} rows, {name}", tokens,
                        target_probs(self.row, params))
        params = [SamplingParams(temperature=0.0 if i % 4 == 0 else 0.8, top_p=0.9)
                  for i in range(NUM_ROWS)]
        tokens = self.kernels.sample(logits.clone(),
                                     random_rows(metadata(params, self.device)))
        random = torch.arange(NUM_ROWS, device=self.device) % 4 != 0
        self._check("sample distribution", "rows with temperature 0.8, top-p 0.9 among "
                    "greedy ones (every 4th row)", tokens[random], target_probs(self.row,
                                                                                params[1]))

    def seeded_rows(self) -> None:
        from lmkit.api.sampling_params import SamplingParams
        from lmkit.sample.kernels import TorchSamplingKernels, random_rows

        logits = self.torch.randn(8, VOCAB, generator=self.torch.Generator().manual_seed(1))
        logits = logits.to(self.device)
        params = [SamplingParams(temperature=0.9, top_p=0.9)] * 8
        seeds = [None, 7, None, None, None, 123, None, None]
        got = self.kernels.sample(logits.clone(), random_rows(metadata(params, self.device,
                                                                       seeds)))
        want = TorchSamplingKernels(device=self.device).sample(
            logits.clone(), random_rows(metadata(params, self.device, seeds)))
        if got[[1, 5]].tolist() != want[[1, 5]].tolist():
            raise self.t.fail(SUITE, "seeded rows", "8 rows, rows 1 and 5 seeded (7, 123)",
                              f"seeded rows drew {got[[1, 5]].tolist()}, the torch kernels "
                              f"{want[[1, 5]].tolist()} with the same seeds: a seeded row "
                              "must draw from its own generator as the torch path does")

    def _verify(self, kernels: Any, params: Any, num_reqs: int, draft: int,
                seeds: list[int | None] | None = None) -> Any:
        from lmkit.sample.drafts import DraftLayout
        from lmkit.sample.draws import compute_probs
        from lmkit.sample.kernels import random_rows

        md = metadata([params] * (2 * num_reqs), self.device, seeds)
        probs = compute_probs(self.row.expand(2 * num_reqs, VOCAB).contiguous(), md)
        layout = DraftLayout.build([[draft]] * num_reqs, self.device)
        row_tokens, accepted = kernels.verify(probs, random_rows(md), layout, None)
        # the first emitted token: the draft where accepted, else the row's own draw
        return self.torch.where(accepted, layout.token_ids, row_tokens[layout.rows])

    def verify_distribution(self) -> None:
        from lmkit.api.sampling_params import SamplingParams

        self.torch.manual_seed(1)
        for name, kwargs in (("temperature 0.8", {"temperature": 0.8}),
                             ("top-p 0.9", {"temperature": 0.8, "top_p": 0.9})):
            params = SamplingParams(**kwargs)
            target = target_probs(self.row, params)
            draft = int(target.argsort(descending=True)[1])
            first = self._verify(self.kernels, params, NUM_ROWS, draft)
            self._check("verify distribution", f"{NUM_ROWS} requests, {name}, one draft "
                        f"(token {draft})", first, target)

    def verify_seeded(self) -> None:
        from lmkit.api.sampling_params import SamplingParams
        from lmkit.sample.kernels import TorchSamplingKernels

        params = SamplingParams(temperature=0.9, top_p=0.9)
        seeds = [None, None, 5, 5, None, None, 9, 9]  # requests 1 and 3 seeded
        got = self._verify(self.kernels, params, 4, 3, seeds)
        want = self._verify(TorchSamplingKernels(device=self.device), params, 4, 3, seeds)
        if got[[1, 3]].tolist() != want[[1, 3]].tolist():
            raise self.t.fail(SUITE, "verify seeded", "4 requests, one draft each, requests "
                              "1 and 3 seeded", f"seeded requests emitted {got[[1, 3]].tolist()}"
                              f", the torch kernels {want[[1, 3]].tolist()} with the same seeds")


    def device_step(self) -> None:
        from lmkit.sample.kernels import TorchSamplingKernels

        torch = self.torch
        base = TorchSamplingKernels(device=self.device)
        for k in (1, 2, 4):
            n, width, bs = 6, k + 1, 4
            gen = torch.Generator().manual_seed(k)
            inputs = torch.randint(0, VOCAB, (n, width), generator=gen)
            targets = inputs.roll(-1, dims=1)
            for i in range(n):  # request i's first wrong draft at i % (k + 1) (k: none)
                if i % width < k:
                    targets[i, i % width] = (targets[i, i % width] + 1) % VOCAB
            positions = torch.randint(0, 9, (n, 1), generator=gen) + torch.arange(width)
            tables = torch.randperm(n * 8, generator=gen).view(n, 8).to(torch.int32)
            targets, inputs, positions, tables = (t.to(self.device) for t in
                                                  (targets, inputs, positions, tables))
            args = (targets, inputs, positions[:, 0], tables, bs)
            got, want = self.kernels.plan_device_step(*args), base.plan_device_step(*args)
            what = f"{n} requests, {k} drafts each, accepting 0..{k}"
            if any(not torch.equal(g, w) for g, w in zip(got, want, strict=True)):
                raise self.t.fail(SUITE, "device step", what, "plan_device_step differs from "
                                  "the torch default")
            first = torch.randint(0, VOCAB, (n,), generator=gen).to(self.device)
            rest = (torch.randint(0, VOCAB, (k - 1, n), generator=gen).to(self.device)
                    if k > 1 else None)
            outs = [torch.full((n, w), -1, device=self.device) for w in (2 * width,) + (width,) * 3]
            refs = [torch.full_like(o, -1) for o in outs]
            self.kernels.finish_device_step(targets, want[0], want[1], first, rest, tables, bs,
                                            *outs)
            base.finish_device_step(targets, want[0], want[1], first, rest, tables, bs, *refs)
            if any(not torch.equal(o, r) for o, r in zip(outs, refs, strict=True)):
                raise self.t.fail(SUITE, "device step", what, "finish_device_step wrote other "
                                  "values than the torch default")


    def penalties(self) -> None:
        from lmkit.api.sampling_kernels import PenaltyRows
        from lmkit.sample.kernels import TorchSamplingKernels

        torch = self.torch
        gen = torch.Generator().manual_seed(3)
        num_rows, num_slots = 5, 4
        counts = torch.randint(0, 3, (num_slots, VOCAB), generator=gen, dtype=torch.int32)
        seen = (counts > 0) | (torch.rand(num_slots, VOCAB, generator=gen) < 0.2)
        logits = torch.randn(num_rows, VOCAB, generator=gen) * 3
        logits[:, :3] = torch.tensor([0.0, -0.0, 1e-30])  # signs and a tiny value
        for drafts in (False, True):
            draft_counts = None
            if drafts:  # (the row with drafts sees tokens its slot has not)
                draft_counts = torch.zeros(4, VOCAB, dtype=torch.int32)
                draft_counts[2, torch.randint(0, VOCAB, (3,), generator=gen)] += 1
            rows = PenaltyRows(
                rows=torch.tensor([4, 0, 1, 3]), slots=torch.tensor([2, 3, 0, 1]),
                counts=counts, seen=seen,
                repetition=torch.tensor([1.3, 0.8, 1.0, 1.1, 1.5]),
                frequency=torch.tensor([0.0, 0.5, -0.3, 0.2, 0.1]),
                presence=torch.tensor([0.4, 0.0, 0.6, -0.2, 0.3]), draft_counts=draft_counts)
            moved = PenaltyRows(**{f: (v.to(self.device) if isinstance(v, torch.Tensor)
                                       else v) for f, v in vars(rows).items()})
            tables = (moved.counts.clone(), moved.seen.clone())
            # (copies: both act in place, and .to() of the CPU returns the same tensor)
            got = self.kernels.apply_penalties(logits.to(self.device, copy=True), moved)
            want = TorchSamplingKernels(device=self.device).apply_penalties(
                logits.to(self.device, copy=True), moved)
            what = f"{num_rows} rows (row 2 without penalties), drafts: {drafts}"
            if not torch.equal(got, want):
                bad = (got != want).nonzero()[:4].tolist()
                raise self.t.fail(SUITE, "penalties", what, "the penalised logits differ "
                                  f"from the torch default's, e.g. at (row, token) {bad}")
            if not (torch.equal(tables[0], moved.counts) and torch.equal(tables[1], moved.seen)):
                raise self.t.fail(SUITE, "penalties", what, "apply_penalties wrote into the "
                                  "kept counts or seen tables")


PROPERTIES = ("sample distribution", "seeded rows", "verify distribution", "verify seeded",
              "device step", "penalties")


def _run(suite: _Suite, prop: str) -> None:
    {"sample distribution": suite.sample_distribution, "seeded rows": suite.seeded_rows,
     "verify distribution": suite.verify_distribution,
     "verify seeded": suite.verify_seeded, "device step": suite.device_step,
     "penalties": suite.penalties}[prop]()


def check_sampling_kernels(kernels: Any, options: Any = None, *, device: str = "cpu",
                           only: Any = None) -> dict[str, str]:
    """Run every property against ``kernels`` (a Spec, Registration or class) on
    ``device``; returns each property's outcome. Raises :class:`ConformanceFailure` at
    the first property that fails."""
    t = resolve_target(kernels, options)
    suite = _Suite(t, device)
    checks = {CONSTRUCTOR_PROPERTY: lambda: None}
    checks.update({p: (lambda p=p: _run(suite, p)) for p in PROPERTIES})
    return run_checks(checks, only)


class SamplingKernelsConformance:
    """pytest base class: one test per property. Define a ``sampling_kernels`` fixture
    returning the spec or class; set ``device`` to test elsewhere than the CPU."""

    device = "cpu"

    def _check(self, sampling_kernels: Any, prop: str) -> None:
        suite = _Suite(resolve_target(sampling_kernels), self.device)
        skip_if_not_applicable(lambda: _run(suite, prop))

    def test_constructor_signature(self, sampling_kernels: Any) -> None:
        _Suite(resolve_target(sampling_kernels), self.device)

    def test_sample_distribution(self, sampling_kernels: Any) -> None:
        self._check(sampling_kernels, "sample distribution")

    def test_seeded_rows(self, sampling_kernels: Any) -> None:
        self._check(sampling_kernels, "seeded rows")

    def test_verify_distribution(self, sampling_kernels: Any) -> None:
        self._check(sampling_kernels, "verify distribution")

    def test_verify_seeded(self, sampling_kernels: Any) -> None:
        self._check(sampling_kernels, "verify seeded")

    def test_device_step(self, sampling_kernels: Any) -> None:
        self._check(sampling_kernels, "device step")

    def test_penalties(self, sampling_kernels: Any) -> None:
        self._check(sampling_kernels, "penalties")
