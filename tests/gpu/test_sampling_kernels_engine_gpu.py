"""The ``triton`` sampling kernels on CUDA: the conformance suite with the compiled
kernels, and the engine on SmolLM2 (vocabulary 49152) with ``--sampling-kernels
triton``: greedy outputs identical to the torch kernels (plain and with n-gram drafts),
and top-p draws of the first token following the model's nucleus (chi-square against
the distribution computed from the raw logprobs).

SmolLM2 comes from ``LMKIT_TEST_SMOLLM2`` (its GGUF file or converted directory) or the
``smollm2_dir`` fixture.
"""

from __future__ import annotations

import itertools
import math

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from lmkit import SamplingParams  # noqa: E402
from lmkit.frontend.llm import LLM  # noqa: E402
from lmkit.testing.sampling_kernels import check_sampling_kernels, chi_square  # noqa: E402
from lmkit_plugins.sampling import TRITON  # noqa: E402
from lmkit_plugins.sampling.triton_kernels import TritonSamplingKernels  # noqa: E402

PROMPT = [{"role": "user", "content": "Name one colour."}]


def test_conformance_on_cuda():
    assert set(check_sampling_kernels(TRITON, device="cuda").values()) == {"passed"}


def _prompts(llm: LLM) -> list[list[int]]:
    def chat(text):
        return llm.input_processor.tokenize(None, [{"role": "user", "content": text}])[1]

    return [chat("Repeat exactly: the quick brown fox jumps over the lazy dog. " * 3),
            chat("Why is the sky blue?"), chat("Write a haiku about the ocean.")]


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_greedy_outputs_identical(smollm2, speculative):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    spec = dict(speculative=speculative, num_speculative_tokens=4) if speculative else {}
    outs = {}
    for kernels in ("torch", "triton"):
        with LLM(str(smollm2), device="cuda", dtype="float32", sampling_kernels=kernels,
                 **spec) as llm:
            assert llm.engine.executor.runner.sampler.kernels.__class__.__name__ == {
                "torch": "TorchSamplingKernels", "triton": "TritonSamplingKernels"}[kernels]
            outs[kernels] = [o.outputs[0].token_ids for o in llm.generate(_prompts(llm),
                                                                          params)]
    assert outs["triton"] == outs["torch"]


def test_auto_chooses_triton_on_cuda(smollm2):
    with LLM(str(smollm2), device="cuda") as llm:
        assert isinstance(llm.engine.executor.runner.sampler.kernels, TritonSamplingKernels)


def test_top_p_draws_follow_the_nucleus(smollm2):
    num = 512
    with LLM(str(smollm2), device="cuda", dtype="float32", sampling_kernels="triton",
             max_num_seqs=256) as llm:
        prompt = llm.input_processor.tokenize(None, PROMPT)[1]
        probe = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1,
                                                      logprobs=20))[0]
        top = probe.outputs[0].logprobs[0]  # the raw distribution's 20 most likely tokens
        ranked = sorted(((lp, tok) for tok, lp in top.top), reverse=True)
        probs = [math.exp(lp) for lp, _ in ranked]
        # top_p halfway between two cumulative sums, with the nucleus inside the top 20
        # whatever the prompt's distribution: no token sits on the boundary
        cum = list(itertools.accumulate(probs))
        k = next(i for i, c in enumerate(cum) if c >= 0.6 * cum[-1])
        top_p = (cum[k] + (cum[k - 1] if k else 0.0)) / 2
        draws = llm.generate([prompt] * num, SamplingParams(temperature=1.0, top_p=top_p,
                                                            max_tokens=1))
    kept = [(tok, p) for p, (_, tok) in zip(probs[:k + 1], ranked, strict=False)]
    mass = cum[k]
    vocab = max(t for t, _ in kept) + 1
    expected = torch.zeros(vocab)
    for tok, p in kept:
        expected[tok] = p / mass
    tokens = torch.tensor([o.outputs[0].token_ids[0] for o in draws])
    assert int(tokens.max()) < vocab and bool((expected[tokens] > 0).all()), \
        "a token outside the nucleus was drawn"
    stat, limit = chi_square(tokens, expected)
    assert stat < limit, f"chi-square {stat:.1f} >= {limit}"

