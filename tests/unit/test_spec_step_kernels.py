"""The device step's bookkeeping kernels (:mod:`lmkit_kernels.spec_step`) in Triton's
interpreter against the torch ops they replace (the API's defaults): every accepted count from none to all k,
k from 1 to 5, positions whose passes and next verification cross cache blocks, strided
starts (a column of the positions), and the refusals of wrong shapes."""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu")
torch = pytest.importorskip("torch")

from lmkit.api import TorchSamplingKernels  # noqa: E402
from lmkit_kernels.spec_step import finish_step, plan_step  # noqa: E402

# the torch ops the kernels replace: the API's default bookkeeping
plan_step_ref = TorchSamplingKernels(device=None).plan_device_step
finish_step_ref = TorchSamplingKernels(device=None).finish_device_step


def _case(n, k, seed, block_size=4):
    g = torch.Generator().manual_seed(seed)
    width = k + 1
    inputs = torch.randint(0, 50, (n, width), generator=g)
    targets = inputs.roll(-1, dims=1)  # drafts right everywhere ...
    for i in range(n):  # ... up to a chosen first miss per request (k: none)
        miss = i % (k + 1)
        if miss < k:
            targets[i, miss] = inputs[i, miss + 1] + 1
    targets[:, k] = torch.randint(0, 50, (n,), generator=g)
    positions = torch.randint(0, 20, (n, 1)) + torch.arange(width)
    tables = torch.randperm(128, generator=g)[:n * 12].view(n, 12).to(torch.int32)
    return targets, inputs, positions, tables, block_size


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [1, 3, 7])
def test_plan_and_finish_equal_the_torch_steps(n, k):
    targets, inputs, positions, tables, bs = _case(n, k, seed=10 * n + k)
    start = positions[:, 0]  # a strided column, as the step passes it
    got = plan_step(targets, inputs, start, tables, bs)
    want = plan_step_ref(targets, inputs, start, tables, bs)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert got[0].tolist() == [min(i % (k + 1), k) for i in range(n)]
    accepted, last = got[0], got[1]
    first = torch.randint(0, 50, (n,))
    rest = torch.randint(0, 50, (k - 1, n)) if k > 1 else None
    outs = [torch.full((n, 2 * (k + 1)), -1)] + [torch.full((n, k + 1), -1) for _ in range(3)]
    refs = [torch.full_like(o, -1) for o in outs]
    finish_step(targets, accepted, last, first, rest, tables, bs, *outs)
    finish_step_ref(targets, accepted, last, first, rest, tables, bs, *refs)
    for o, r in zip(outs, refs, strict=True):
        assert torch.equal(o, r)


def test_an_empty_step_and_wrong_shapes():
    targets, inputs, positions, tables, bs = _case(0, 3, seed=0)
    accepted, last, rows, chain = plan_step(targets, inputs, positions[:, 0], tables, bs)
    assert accepted.shape == (0,) and chain.shape == (2, 3, 0)
    targets, inputs, positions, tables, bs = _case(2, 3, seed=1)
    with pytest.raises(ValueError, match=r"inputs: expected int64 \[2, 4\]"):
        plan_step(targets, inputs[:, :3], positions[:, 0], tables, bs)
    with pytest.raises(ValueError, match=r"tables: expected int32 \[2, blocks\]"):
        plan_step(targets, inputs, positions[:, 0], tables.long(), bs)
    a, last, _, _ = plan_step(targets, inputs, positions[:, 0], tables, bs)
    outs = [torch.empty(2, 8, dtype=torch.int64)] + [torch.empty(2, 4, dtype=torch.int64)] * 3
    with pytest.raises(ValueError, match="rest: the other 2 drafts are needed for k=3"):
        finish_step(targets, a, last, a, None, tables, bs, *outs)
