"""The sampler on a CUDA device: same greedy choices and masks as on CPU, seeded rows
reproducible with CUDA generators."""

from __future__ import annotations

import pytest
import torch
from lmkit.api.sampling_params import SamplingParams
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.sampler import Sampler, compute_probs, make_generator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
VOCAB = 1000


def build(params, device, generators=None, outputs=None):
    n = len(params)
    return SamplingMetadata.build(params, [[1, 2, 3]] * n, outputs or [[4, 4, 5]] * n,
                                  generators or [None] * n, [0] * n, VOCAB, device)


def test_cuda_matches_cpu_for_greedy_and_filters():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB) * 3
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={7: 3.0}),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, min_tokens=5),
        SamplingParams(temperature=0.9, top_k=20),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.1),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, presence_penalty=0.5),
    ]
    cuda = torch.device("cuda")
    cpu_md, cuda_md = build(params, torch.device("cpu")), build(params, cuda)
    cpu_out = Sampler()(logits, cpu_md).sampled_token_ids
    cuda_out = Sampler()(logits.to(cuda), cuda_md).sampled_token_ids
    assert cuda_out.device.type == "cuda"
    assert cuda_out[:2].tolist() == cpu_out[:2].tolist()
    cpu_probs = compute_probs(logits.clone(), cpu_md)
    cuda_probs = compute_probs(logits.to(cuda), cuda_md).cpu()
    assert torch.equal(cpu_probs[2:] > 0, cuda_probs[2:] > 0)
    assert torch.allclose(cpu_probs, cuda_probs, atol=1e-5)
    # Random rows only ever pick tokens their filters keep.
    assert bool((cuda_probs[torch.arange(6), cuda_out.cpu()] > 0).all())


def test_cuda_seeded_rows_reproducible_across_batches():
    cuda = torch.device("cuda")
    torch.manual_seed(1)
    target = (torch.randn(VOCAB) * 0.5).to(cuda)
    others = torch.randn(3, VOCAB, device=cuda)
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run(params, gens, logits, row):
        return [Sampler()(logits, build(params, cuda, gens)).sampled_token_ids[row].item()
                for _ in range(8)]

    alone = run([seeded], [make_generator(42, cuda)], target[None], 0)
    mixed = run([SamplingParams(), SamplingParams(temperature=0.0), seeded, SamplingParams()],
                [None, None, make_generator(42, cuda), None],
                torch.cat([others[:2], target[None], others[2:]]), 2)
    assert alone == mixed and len(set(alone)) > 1


def test_cuda_sampled_frequencies_match_softmax():
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.5], device=cuda)
    num = 100_000
    params = [SamplingParams(temperature=0.7)] * num
    md = SamplingMetadata.build(params, [[]] * num, [[]] * num, [None] * num, [None] * num,
                                5, cuda)
    ids = Sampler()(logits.expand(num, 5).contiguous(), md).sampled_token_ids
    freq = torch.bincount(ids, minlength=5).float() / num
    assert torch.allclose(freq, (logits / 0.7).softmax(-1), atol=0.008)


def test_kept_tensors_on_cuda_adjust_as_the_cpu_does_step_after_step():
    """The runner's per-request tensors (lmkit.sample.row_cache) on CUDA: penalties,
    bias and allowed ids, with draft rows, equal the CPU's adjusted logits bit for bit
    at every step (dense passes there, a scan of the seen tokens on the CPU)."""
    from lmkit.sample.draws import adjust_logits
    from lmkit.sample.row_cache import SamplingCache
    from lmkit.spec_decode.rows import DraftExtendedTokens

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4),
              SamplingParams(presence_penalty=-0.6, logit_bias={3: 2.0, 9: -1.0}),
              SamplingParams(allowed_token_ids=[1, 5, 9, 700], repetition_penalty=0.8),
              SamplingParams(temperature=0.7)]
    outs = [[4, 4, 5], [6], [9, 9], [1]]
    caches = {d: SamplingCache(VOCAB, d) for d in (cpu, cuda)}
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        drafts = [2, 8] if step % 2 else []
        rows = [(i, out if j == 0 else DraftExtendedTokens(out, drafts, j))
                for i, out in enumerate(outs) for j in range(1 + (len(drafts) if i == 0 else 0))]
        logits = torch.randn(len(rows), VOCAB, generator=g) * 3
        got = {}
        for d, cache in caches.items():
            md = SamplingMetadata.build([params[i] for i, _ in rows], [[1, 2, 3]] * len(rows),
                                        [o for _, o in rows], [None] * len(rows),
                                        [0] * len(rows), VOCAB, d, cache,
                                        [str(i) for i, _ in rows])
            got[d] = adjust_logits(logits.clone().to(d), md).cpu()
        assert torch.equal(got[cuda], got[cpu]), f"step {step}"
        for out in outs:
            out.append(int(torch.randint(0, VOCAB, (1,), generator=g)))
