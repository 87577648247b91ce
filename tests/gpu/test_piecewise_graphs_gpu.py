"""Piecewise CUDA graphs on the GPU: mixed steps replayed piece by piece equal the eager
forward, padding rows write nothing to the KV cache, and the engine takes its mixed
steps through them with unchanged outputs.

bf16 with the triton backend: the model writes K/V inside the captured RoPE kernel (at
the runner's fixed slot buffer), so a padding row with a stale slot would overwrite a
real cache entry -- the KV comparison catches that. The CPU tests
(tests/unit/test_piecewise_graphs.py) check the padded path without capture.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_only import require_cuda_and_triton  # noqa: E402

require_cuda_and_triton()
pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from lmkit import SamplingParams  # noqa: E402
from lmkit.api.model import ForwardContext  # noqa: E402
from lmkit.frontend.llm import LLM  # noqa: E402
from lmkit.testing.tiny_model import load_tiny_model, make_tiny_model  # noqa: E402
from lmkit.worker.input_batch import CachedRequestState, DeviceInputs, InputBatch  # noqa: E402
from lmkit.worker.piecewise_graphs import PiecewiseGraphRunner  # noqa: E402
from lmkit_plugins.attention.triton_backend import TritonAttention  # noqa: E402
from lmkit_plugins.models.llama import LlamaForCausalLM  # noqa: E402

BLOCK = 16
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("pw"), vocab_size=512, num_layers=3,
                           hidden_size=256, num_heads=4, num_kv_heads=2,
                           max_position_embeddings=1024)


@pytest.fixture(scope="module")
def bf16_model(model_dir):
    model = load_tiny_model(model_dir, LlamaForCausalLM, TritonAttention,
                            dtype=torch.bfloat16, device=CUDA, block_size=BLOCK)
    assert model._model_writes_kv  # the case this file is about
    return model


def _mixed_step(context_lens, prompt_len, seed):
    batch = InputBatch(8, 512, BLOCK, 512)
    rng = np.random.default_rng(seed)
    for i, ctx in enumerate([*context_lens, 0]):
        tokens = rng.integers(0, 512, (ctx + 1) if i < len(context_lens) else prompt_len)
        state = CachedRequestState(str(i), tokens.tolist(), [], None, None, None, ctx)
        num_blocks = -(-max(ctx + 1, len(tokens)) // BLOCK)
        batch.add_request(state, [1 + 20 * i + j for j in range(num_blocks)])
    n = len(context_lens)
    return batch.prepare(np.arange(n + 1), np.array([1] * n + [prompt_len]), n)


def _plan(model, step, dev):
    model.attn.plan(step.attention_metadata(dev))


def test_replayed_pieces_equal_the_eager_forward(bf16_model):
    model = bf16_model
    shape = model.attn.kv_cache_shape(128)
    g = torch.Generator(device=CUDA).manual_seed(1)
    caches = [torch.randn(shape, generator=g, device=CUDA, dtype=torch.bfloat16)
              for _ in range(3)]
    eager_caches = [c.clone() for c in caches]
    runner = PiecewiseGraphRunner(model, caches, CUDA, max_tokens=96)
    with torch.inference_mode():
        runner.capture()
        assert runner.sizes[-1] == 96 and len(runner._captured) == len(runner.sizes)
        assert all(len(c.graphs) == 4 for c in runner._captured.values())  # 3 layers + 1
        inputs = DeviceInputs(CUDA)
        # a larger step first (its slots stay in the buffers), then smaller ones
        for seed, (ctxs, prompt) in enumerate([([60, 7, 30], 80), ([12, 41], 9), ([5], 20)]):
            step = _mixed_step(ctxs, prompt, seed)
            dev = inputs.copy(step)
            _plan(model, step, dev)
            expected = model(dev.input_ids, dev.positions,
                             ForwardContext(model.attn, eager_caches)).clone()
            _plan(model, step, dev)
            actual = runner.run(dev, step.num_tokens).clone()
            torch.cuda.synchronize()
            assert runner.padded_size(step.num_tokens) > step.num_tokens
            torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)
            for got, want in zip(caches, eager_caches, strict=True):
                # the same slots written, nothing else (a padding write would replace a
                # random value by an unrelated one)
                torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert runner.num_replays == 3


def _generate(model_dir, piecewise: int, dtype: str):
    llm = LLM(str(model_dir), attention="triton", dtype=dtype, device="cuda",
              max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
              num_blocks=512, gpu_memory_utilization=0.3,
              **{"executor.piecewise_max_tokens": piecewise})
    try:
        runner = llm.engine.executor.runner
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist()
                   for n in (3, 40, 170, 300, 12, 90, 7, 500)]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                    ignore_eos=True))
        replays = runner.piecewise.num_replays if runner.piecewise is not None else 0
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], replays


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_mixed_steps_through_pieces(model_dir, dtype):
    with_pieces, replays = _generate(model_dir, 2048, dtype)
    eager, none = _generate(model_dir, 0, dtype)
    assert replays > 0 and none == 0
    if dtype == "float32":
        assert with_pieces == eager
    else:  # bf16: padded GEMM shapes may round a near-tie the other way, rarely
        same = sum(a == b for x, y in zip(with_pieces, eager, strict=True)
                   for a, b in zip(x, y, strict=True))
        assert same >= 0.95 * sum(len(x) for x in eager), (with_pieces, eager)
