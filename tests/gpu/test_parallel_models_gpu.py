"""Tensor parallelism at real shapes on two GPUs (NCCL), through the ``mp`` and the
``ray`` executor:

* SmolLM2-135M-Instruct in float32: ``--tp 2`` gives ``--tp 1``'s greedy tokens. Its 9
  query / 3 key-value heads do not divide by 2, so the ranks hold 6/2 and 3/1 heads
  (:func:`lmkit.api.kv_heads_of_rank`).
* Llama-3.1-8B's shape (2 layers, a copy circuit decides the argmax: see
  :mod:`copy_circuit_model`) in bf16 with CUDA graphs: ``--tp 2``'s logprobs under
  teacher forcing are within the bf16 tolerance of transformers' that every other GPU
  test holds (:func:`teacher_forcing.check_against_hf`: argmax agreement >= 99% where HF
  decides stably).

``LMKIT_TEST_SMOLLM2`` may point at the GGUF file (the GPU machine has no network).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import teacher_forcing as tf  # noqa: E402
from copy_circuit_model import llama_config, write_copy_circuit_model  # noqa: E402
from lmkit import LLM, SamplingParams  # noqa: E402

EXECUTORS = ["mp", pytest.param("ray", marks=pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray is not installed"))]
ENGINE = dict(device="cuda", max_num_seqs=8, max_model_len=2048, num_blocks=1024,
              progress=False)


def _llm(model_dir: Path, tp: int, executor: str, **settings) -> LLM:
    llm = LLM(str(model_dir), tensor_parallel_size=tp,
              **{"parallel.distributed_backend": executor}, **ENGINE, **settings)
    assert llm.engine.stack.get("executor").name == (executor if tp > 1 else "uniproc")
    return llm


@pytest.fixture(scope="module")
def smollm2_tp1(smollm2):
    """SmolLM2's greedy tokens (float32, 64 new tokens) on one GPU."""
    prompts = tf.smollm2_prompts(smollm2)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with _llm(smollm2, 1, "mp", dtype="float32") as llm:
        return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_smollm2_float32_tp2_greedy_equals_tp1(smollm2, smollm2_tp1, executor):
    prompts, one = smollm2_tp1
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with _llm(smollm2, 2, executor, dtype="float32") as llm:
        two = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert len(two) == len(one) == 20 and all(len(ids) == 64 for ids in two)
    assert two == one


@pytest.fixture(scope="module")
def llama8b_shape(tmp_path_factory) -> Path:
    return write_copy_circuit_model(tmp_path_factory.mktemp("llama8b-tp"), llama_config(2),
                                    device="cuda")


@pytest.mark.parametrize("executor", EXECUTORS)
def test_llama8b_shape_tp2_teacher_forced_within_bf16_tolerance(llama8b_shape, hf_refs,
                                                                 executor):
    prompts = tf.random_prompts(tf.llama8b_shape_vocab(llama8b_shape))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=tf.TOP,
                            prompt_logprobs=tf.TOP)
    with _llm(llama8b_shape, 2, executor, dtype="bfloat16", attention="triton") as llm:
        assert not llm.config.executor.enforce_eager  # decode replays CUDA graphs
        outs = llm.generate(prompts, params)
    stats = tf.check_against_hf(outs, *hf_refs(llama8b_shape))
    assert stats["positions"] >= 400
    for out in outs:  # the copy circuit end to end: each token repeats the one two back
        seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        n = len(out.prompt_token_ids)
        if n >= 2:
            assert seq[n:] == [seq[i - 2] for i in range(n, len(seq))]
