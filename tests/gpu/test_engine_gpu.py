"""The engine on CUDA against Hugging Face transformers, for every attention backend,
with CUDA graphs on and off.

Teacher forcing: lmkit generates greedily (bf16) with the top-5 logprobs of every
prompt and output position; transformers then scores the same token sequences in one
forward, in bf16 and in float32. lmkit's argmax must equal HF bf16's at >= 99% of the
positions HF decides stably (its own bf16 and float32 runs agree: on a 135M model a
percent or two of positions are ties at bf16 precision, where they disagree too),
and lmkit's top-5 logprobs must be as close to HF float32 as HF's own bf16 run is
(mean error at most twice HF bf16's plus 0.02): "within bf16 tolerance". Decode
positions run through the captured graphs when graphs are on.

Models: SmolLM2-135M-Instruct (the default model; ``LMKIT_TEST_SMOLLM2`` may point at
its GGUF file or converted directory, else the ``smollm2_dir`` fixture fetches it),
and a 2-layer Llama-3.1-8B-shaped model whose argmax is decided by attention
(:mod:`copy_circuit_model`; random Gaussian weights would make the argmax a coin toss
under bf16 rounding). Float32 greedy generation must equal transformers' exactly on
SmolLM2.

``LMKIT_GPU_TEST_DEVICE=cpu`` runs the same checks on the CPU with the torch backend
(slow; for developing this file without a GPU).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
DEVICE = os.environ.get("LMKIT_GPU_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.gpu
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if DEVICE == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 would run the kernels in the interpreter; unset it",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends import backend_params  # noqa: E402
from copy_circuit_model import llama_config, write_copy_circuit_model  # noqa: E402
from lmkit import SamplingParams  # noqa: E402
from lmkit.frontend.llm import LLM  # noqa: E402
from teacher_forcing import (  # noqa: E402
    TOP,
    check_against_hf,
    llama8b_shape_vocab,
    random_prompts,
    smollm2_prompts,
)

if DEVICE == "cuda":
    BACKENDS = backend_params("torch", "triton", "flashinfer", "flash_attn")
else:
    BACKENDS = ["torch"]
GRAPHS = [pytest.param(True, id="graphs"), pytest.param(False, id="eager")]
NEW_TOKENS = 24
ENGINE = dict(max_num_seqs=8, max_model_len=2048, num_blocks=1024, device=DEVICE)


# ---------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def llama8b_shape(tmp_path_factory) -> Path:
    """Llama-3.1-8B's shape with 2 layers, first layer a previous-token copy circuit."""
    return write_copy_circuit_model(tmp_path_factory.mktemp("llama8b"), llama_config(2),
                                    device=DEVICE)


def _lmkit_generate(model_dir: Path, prompts, backend: str, graphs: bool, dtype: str,
                    logprobs: bool = True, ignore_eos: bool = True):
    llm = LLM(str(model_dir), attention=backend, enforce_eager=not graphs, dtype=dtype,
              **ENGINE)
    try:
        runner = llm.engine.executor.runner
        captured = runner.cuda_graphs is not None
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=ignore_eos,
                                logprobs=TOP if logprobs else None,
                                prompt_logprobs=TOP if logprobs else None)
        outs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    return outs, captured


def _expect_graphs(backend: str, graphs: bool, captured: bool) -> None:
    if DEVICE != "cuda":
        assert not captured
        return
    assert captured == (graphs and backend != "torch")  # torch has no cuda_graphs cap


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_teacher_forced_logits_match_hf(smollm2, hf_refs, backend, graphs):
    outs, captured = _lmkit_generate(smollm2, smollm2_prompts(smollm2), backend, graphs,
                                     "bfloat16")
    _expect_graphs(backend, graphs, captured)
    check_against_hf(outs, *hf_refs(smollm2))


@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_llama8b_shape_teacher_forced_logits_match_hf(llama8b_shape, hf_refs, backend, graphs):
    prompts = random_prompts(llama8b_shape_vocab(llama8b_shape))
    outs, captured = _lmkit_generate(llama8b_shape, prompts, backend, graphs, "bfloat16")
    _expect_graphs(backend, graphs, captured)
    check_against_hf(outs, *hf_refs(llama8b_shape))
    # the copy circuit works end to end: each output token repeats the one two back
    for out in outs:
        seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        n = len(out.prompt_token_ids)
        if n >= 2:
            assert seq[n:] == [seq[i - 2] for i in range(n, len(seq))]


def _name(param) -> str:
    return param if isinstance(param, str) else param.values[0]


HALF_ONLY = ("flashinfer", "flash_attn")
FP32_BACKENDS = [b for b in BACKENDS if _name(b) not in HALF_ONLY]


@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("backend", FP32_BACKENDS)
def test_smollm2_float32_greedy_equals_hf(smollm2, hf_refs, backend, graphs):
    prompts = smollm2_prompts(smollm2)
    outs, captured = _lmkit_generate(smollm2, prompts, backend, graphs, "float32",
                                     logprobs=False, ignore_eos=False)
    _expect_graphs(backend, graphs, captured)
    _, hf32 = hf_refs(smollm2)
    eos = hf32.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt], device=DEVICE)
        with torch.inference_mode():
            ref = hf32.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=NEW_TOKENS, pad_token_id=0)
        expected = ref[0, len(prompt):].tolist()
        stop = next((i for i, t in enumerate(expected) if t in eos), None)
        if stop is not None:  # both stop at EOS; lmkit's output ends with it
            expected = expected[:stop + 1]
        assert list(out.outputs[0].token_ids) == expected


GRAPH_BACKENDS = [b for b in BACKENDS if _name(b) != "torch"]  # captured in CUDA graphs


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_llama8b_shape_greedy_decode_lookahead(llama8b_shape, backend):
    """Plain greedy requests (no logprobs) decode through steps launched ahead of the
    scheduler (lmkit.worker.gpu_lookahead); the tokens follow the copy circuit."""
    prompts = random_prompts(llama8b_shape_vocab(llama8b_shape))
    llm = LLM(str(llama8b_shape), attention=backend, dtype="bfloat16", **ENGINE)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                    ignore_eos=True))
        lookahead = llm.engine.executor.runner.lookahead
        assert lookahead is not None and lookahead.stats.used > NEW_TOKENS // 2
    finally:
        llm.shutdown()
    for out in outs:
        seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        n = len(out.prompt_token_ids)
        assert len(seq) == n + NEW_TOKENS
        if n >= 2:
            assert seq[n:] == [seq[i - 2] for i in range(n, len(seq))]
