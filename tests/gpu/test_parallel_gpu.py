"""The distributed executors on CUDA: ``mp`` at TP=1 (the worker in its own process,
CUDA graphs on) gives the same greedy tokens as ``uniproc``; on a host with two or more
GPUs, ``--tp 2`` over NCCL gives the same greedy tokens as ``--tp 1`` in float32."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from lmkit import LLM, SamplingParams  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402

PROMPTS = ["hello there", "a much longer prompt about tensors, ranks and all-reduces", "x",
           "the same prefix twice: the same prefix twice"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gpu-mp"), hidden_size=256,
                           num_heads=8, num_kv_heads=4, num_layers=4)


def greedy_ids(model_dir, **settings) -> tuple[str, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with LLM(str(model_dir), device="cuda", progress=False, **settings) as llm:
        executor = llm.engine.stack.get("executor").name
        return executor, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mp_at_tp1_equals_uniproc(model_dir, dtype):
    name_u, uniproc = greedy_ids(model_dir, dtype=dtype, executor="uniproc")
    name_m, mp = greedy_ids(model_dir, dtype=dtype, executor="mp")
    assert (name_u, name_m) == ("uniproc", "mp")
    assert mp == uniproc
    assert all(len(ids) == 64 for ids in mp)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_over_nccl_equals_tp1(model_dir):
    _, one = greedy_ids(model_dir, dtype="float32", tensor_parallel_size=1)
    name, two = greedy_ids(model_dir, dtype="float32", tensor_parallel_size=2)
    assert name == "mp" and two == one
