"""The compiled Triton rejection-sampling kernel on CUDA against its torch reference at
a real vocabulary (151936), with and without draft distributions."""

from __future__ import annotations

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from lmkit_kernels.rejection_sample import rejection_sample, rejection_sample_ref  # noqa: E402

CUDA = torch.device("cuda")


@pytest.mark.parametrize("with_q", [False, True])
def test_kernel_matches_reference_at_a_real_vocabulary(with_q):
    g = torch.Generator().manual_seed(0)
    vocab, num_reqs = 151936, 48
    num_drafts = torch.randint(0, 6, (num_reqs,), generator=g)
    num_rows = int(num_drafts.sum()) + num_reqs
    probs = torch.softmax(torch.randn(num_rows, vocab, generator=g) * 4, dim=-1)
    starts = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    drafts = []
    for i in range(num_reqs):  # half the drafts are the argmax, so runs get accepted
        for j in range(int(num_drafts[i])):
            top = int(probs[int(starts[i]) + j].argmax())
            drafts.append(top if j % 2 == 0 or i % 3 else int(torch.randint(vocab, (1,),
                                                                            generator=g)))
    n = len(drafts)
    q = torch.softmax(torch.randn(n, vocab, generator=g) * 4, dim=-1) if with_q else None
    args = dict(target_probs=probs, draft_token_ids=torch.tensor(drafts, dtype=torch.int64),
                cu_num_drafts=num_drafts.cumsum(0), uniform=torch.rand(n, generator=g),
                noise=torch.empty(num_rows, vocab).exponential_(generator=g),
                max_num_drafts=int(num_drafts.max()),
                is_greedy=torch.arange(num_reqs) % 4 == 0, draft_probs=q)
    on_gpu = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    out, num_acc = rejection_sample(**on_gpu)
    ref_out, ref_acc = rejection_sample_ref(**args)
    assert torch.equal(out.cpu(), ref_out) and torch.equal(num_acc.cpu(), ref_acc)
    assert int(num_acc.sum()) > 0
