"""The compiled penalties kernel (:mod:`lmkit_kernels.penalties`) on CUDA against the
core's torch path at a real shape (256 rows x 151,936): bit for bit against the CUDA
dense passes and the CPU scan, with and without drafts; the ``triton`` sampling
kernels take it through the sampler's call."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from lmkit.api import TorchSamplingKernels  # noqa: E402
from lmkit.api.sampling_params import SamplingParams  # noqa: E402
from lmkit.sample.metadata import SamplingMetadata  # noqa: E402
from lmkit.sample.row_cache import SamplingCache  # noqa: E402
from lmkit.spec_decode.rows import DraftExtendedTokens  # noqa: E402
from lmkit_kernels.penalties import apply_penalties  # noqa: E402
from lmkit_plugins.sampling import triton_kernels  # noqa: E402
from lmkit_plugins.sampling.triton_kernels import TritonSamplingKernels  # noqa: E402

CUDA = torch.device("cuda")
VOCAB = 151936
ROWS = 256
MIXES = [dict(temperature=0.7, repetition_penalty=1.1, presence_penalty=0.3),
         dict(temperature=0.0, repetition_penalty=0.8, frequency_penalty=0.2),
         dict(frequency_penalty=-0.5, presence_penalty=0.1), dict(temperature=0.7)]


def _penalties(drafts_per_request: int):
    """Metadata of a decode step of ROWS rows (``drafts_per_request + 1`` per request),
    512-token prompts and 256 output tokens, after requests came and went (slots out of
    order), and the step's logits."""
    rng = random.Random(drafts_per_request)
    cache = SamplingCache(VOCAB, CUDA)
    num_reqs = ROWS // (drafts_per_request + 1)
    # fill the tables, then drop every third request: the step's slots are out of order
    for i in range(num_reqs + num_reqs // 2):
        p = SamplingParams(repetition_penalty=1.2)
        cache.penalty_rows([f"old{i}"], [p], [[i]], [[i]], [0])
    for i in range(0, num_reqs + num_reqs // 2, 3):
        cache.forget(f"old{i}")
    keys, params, prompts, outputs = [], [], [], []
    for r in range(num_reqs):
        p = SamplingParams(**MIXES[r % len(MIXES)])
        prompt = rng.choices(range(VOCAB), k=512)
        out = rng.choices(range(VOCAB), k=200) + rng.choices(range(50), k=56)  # repeats
        drafts = rng.choices(range(50), k=drafts_per_request)
        for j in range(drafts_per_request + 1):
            keys.append(f"r{r}")
            params.append(p)
            prompts.append(prompt)
            outputs.append(out if j == 0 else DraftExtendedTokens(out, drafts, j))
    md = SamplingMetadata.build(params, prompts, outputs, [None] * ROWS, [None] * ROWS, VOCAB,
                                CUDA, cache, keys)
    gen = torch.Generator(device=CUDA).manual_seed(drafts_per_request)
    logits = torch.randn(ROWS, VOCAB, device=CUDA, generator=gen) * 4
    logits[:, ::97] = float("-inf")  # banned tokens
    return logits, md.penalties


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("drafts_per_request", [0, 3])
def test_the_kernel_equals_the_torch_path_at_a_real_shape(drafts_per_request):
    logits, p = _penalties(drafts_per_request)
    assert p.rows.numel() == ROWS * 3 // 4 and (p.draft_counts is not None) == (
        drafts_per_request > 0)
    assert p.slots.tolist() != sorted(p.slots.tolist())
    want = TorchSamplingKernels(device=CUDA).apply_penalties(logits.clone(), p)  # dense
    got = apply_penalties(logits.clone(), p.rows, p.slots, p.counts, p.seen, p.repetition,
                          p.frequency, p.presence, p.draft_counts)
    torch.cuda.synchronize()
    assert _bit_equal(got, want)
    assert not _bit_equal(got, logits)
    # and the CPU scan, on copies
    on_cpu = replace(p, **{f: getattr(p, f).cpu() for f in (
        "rows", "slots", "counts", "seen", "repetition", "frequency", "presence")},
        draft_counts=None if p.draft_counts is None else p.draft_counts.cpu())
    scanned = TorchSamplingKernels(device=None).apply_penalties(logits.cpu(), on_cpu)
    assert _bit_equal(got.cpu(), scanned)


def test_the_triton_sampling_kernels_launch_it(monkeypatch):
    monkeypatch.delenv(triton_kernels.PENALTY_KERNEL_ENV, raising=False)
    launches = []
    kernel = triton_kernels.triton_penalties
    monkeypatch.setattr(triton_kernels, "triton_penalties",
                        lambda *a, **k: launches.append(1) or kernel(*a, **k))
    logits, p = _penalties(0)
    got = TritonSamplingKernels(device=CUDA).apply_penalties(logits.clone(), p)
    assert launches == [1]
    assert _bit_equal(got, TorchSamplingKernels(device=CUDA).apply_penalties(logits.clone(), p))
