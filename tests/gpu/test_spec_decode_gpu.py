"""Speculative decoding on CUDA: the engine with ``--speculative ngram`` on SmolLM2
(float32 greedy outputs identical to plain decoding for every attention backend that
runs float32, with CUDA graphs on; bf16 runs with drafts accepted). With a backend that
can be captured, verification steps must be replayed through the decode CUDA graphs
(flattened, one decode row per token: ``CudaGraphRunner.num_flattened_replays``).

SmolLM2 comes from ``LMKIT_TEST_SMOLLM2`` (its GGUF file or converted directory) or the
``smollm2_dir`` fixture.
"""

from __future__ import annotations

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from lmkit import SamplingParams  # noqa: E402
from lmkit.benchmarking.workload import copy_passages  # noqa: E402
from lmkit.frontend.llm import LLM  # noqa: E402

CUDA = torch.device("cuda")


def _prompts(llm: LLM) -> list[list[int]]:
    def chat(text):
        return llm.input_processor.tokenize(None, [{"role": "user", "content": text}])[1]

    return [chat(f"Repeat the following text exactly:\n\n{p}") for p in copy_passages()] + [
        chat("Why is the sky blue?"), chat("Write a haiku about the ocean.")]


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_greedy_outputs_identical_float32(smollm2, attention):
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", attention=attention)
    with LLM(str(smollm2), **common) as llm:
        prompts = _prompts(llm)
        base = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for max_num_seqs in (1, 64):
        with LLM(str(smollm2), speculative="ngram", num_speculative_tokens=4,
                 max_num_seqs=max_num_seqs, **common) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            stats = llm.stats()
            graphs = llm.engine.executor.runner.cuda_graphs
            # plain facts only: the graph runner holds the KV caches, and keeping it past
            # shutdown would keep them allocated while the next engine sizes its own
            facts = None if graphs is None else (graphs.max_bs, graphs.num_flattened_replays)
            flat = llm.config.executor.flat_step_max_tokens  # short steps replay them too
            del graphs
        assert got == base, f"max_num_seqs={max_num_seqs}"
        assert stats["spec_mean_accepted_length"] > 2.0
        if attention == "torch":  # no cuda_graphs capability: everything eager
            assert facts is None
        else:  # graphs sized for 1 + k tokens per request (or a short step's tokens),
            # verification replayed
            assert facts is not None and facts[0] == min(max(5 * max_num_seqs, flat), 512)
            assert facts[1] > 0, "verification steps ran eagerly"


def test_bfloat16_runs_and_accepts_drafts(smollm2):
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    with LLM(str(smollm2), device="cuda", dtype="bfloat16", speculative="ngram",
             num_speculative_tokens=4) as llm:
        outs = llm.generate(_prompts(llm), params)
        stats = llm.stats()
        graphs = llm.engine.executor.runner.cuda_graphs
    assert all(len(o.outputs[0].token_ids) == 96 for o in outs)
    assert stats["spec_mean_accepted_length"] > 2.0
    assert graphs is not None and graphs.num_flattened_replays > 0  # flashinfer/triton
