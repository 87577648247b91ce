"""train-eagle's step batches on CUDA: features cached on the CPU go through pinned
staging buffers (two, in turn) and non-blocking copies; batches built back to back
without any wait equal the same batches built on the CPU, so no refill overwrote a
copy still in flight."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from lmkit_plugins.spec.eagle_batches import StepBatcher  # noqa: E402


def test_staged_batches_equal_cpu_batches():
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(300, 64)
    draft_rows = torch.randn(40, 64)
    host = SimpleNamespace(embed=lambda ids: embedding(ids).detach().float())
    cuda_embedding = torch.nn.Embedding(300, 64).cuda()
    cuda_embedding.weight.data.copy_(embedding.weight.data)
    device = SimpleNamespace(embed=lambda ids: cuda_embedding(ids).detach().float())
    on_cpu = StepBatcher(host, draft_rows, "cpu")
    on_gpu = StepBatcher(device, draft_rows.cuda(), "cuda")
    steps = []
    for step in range(6):  # lengths change every step; buffers are reused every other
        sequences = [torch.randint(0, 300, (int(n),)).tolist()
                     for n in torch.randint(3, 200, (8,))]
        features = [(torch.randn(len(s), 192, dtype=torch.bfloat16),
                     torch.randn(len(s), 64, dtype=torch.bfloat16)) for s in sequences]
        starts = [step % 3] * 8
        steps.append((on_gpu(sequences, features, starts), on_cpu(sequences, features, starts)))
    torch.cuda.synchronize()
    for got, want in steps:
        for name in ("embeds", "taps", "lengths", "starts"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
        torch.testing.assert_close(got.want.cpu(), want.want, rtol=1e-4, atol=1e-6)
