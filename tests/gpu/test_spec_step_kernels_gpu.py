"""A speculative device step's bookkeeping kernels (:mod:`lmkit_kernels.spec_step`)
compiled on CUDA, against the torch ops they replace (the API's defaults): k from 1 to 5, every accepted count,
1 to 32 requests, block tables of 16-token blocks, the start a strided column."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_only import require_cuda_and_triton  # noqa: E402

require_cuda_and_triton()
pytestmark = pytest.mark.gpu

import torch  # noqa: E402
from lmkit.api import TorchSamplingKernels  # noqa: E402
from lmkit_kernels.spec_step import finish_step, plan_step  # noqa: E402

# the torch ops the kernels replace: the API's default bookkeeping
plan_step_ref = TorchSamplingKernels(device=None).plan_device_step
finish_step_ref = TorchSamplingKernels(device=None).finish_device_step


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [1, 8, 32])
def test_step_kernels_equal_the_torch_ops(n, k):
    g = torch.Generator().manual_seed(n * 10 + k)
    width, bs = k + 1, 16
    inputs = torch.randint(0, 49152, (n, width), generator=g)
    targets = inputs.roll(-1, dims=1)
    for i in range(n):  # request i's first wrong draft at i % (k + 1) (k: none)
        if i % width < k:
            targets[i, i % width] += 1
    positions = torch.randint(0, 1000, (n, 1), generator=g) + torch.arange(width)
    tables = torch.randperm(4096, generator=g)[:n * 128].view(n, 128).to(torch.int32)
    cuda = [t.cuda() for t in (targets, inputs, positions, tables)]
    targets, inputs, positions, tables = cuda
    got = plan_step(targets, inputs, positions[:, 0], tables, bs)
    want = plan_step_ref(targets, inputs, positions[:, 0], tables, bs)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    first = torch.randint(0, 49152, (n,), device="cuda")
    rest = torch.randint(0, 49152, (k - 1, n), device="cuda") if k > 1 else None
    outs = [torch.full((n, 2 * width), -1, device="cuda")] + [
        torch.full((n, width), -1, device="cuda") for _ in range(3)]
    refs = [torch.full_like(o, -1) for o in outs]
    finish_step(targets, got[0], got[1], first, rest, tables, bs, *outs)
    finish_step_ref(targets, got[0], got[1], first, rest, tables, bs, *refs)
    for a, b in zip(outs, refs, strict=True):
        assert torch.equal(a, b)
