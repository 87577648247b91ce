"""The CUDA-graph runner's padded decode path, on the CPU.

:class:`CudaGraphRunner` pads a decode step of ``n`` requests to a captured size and
runs it from fixed buffers. With ``use_graphs=False`` it does exactly that without
capturing, so here -- a tiny Llama with the ``triton`` attention backend and a tiny
DeepSeek-V3 with ``mla_triton`` (its latent cache), in Triton's interpreter -- the
padded forward must give the eager forward's hidden states and leave the KV cache as
the eager step does (padding rows write nothing). On CUDA the same path is captured
and replayed (tests/gpu/test_engine_gpu.py, tests/gpu/test_deepseek_gpu.py).
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: the graph path is tested in tests/gpu")
torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from graph_models import BLOCK, random_caches, tiny_deepseek, tiny_model  # noqa: E402, F401
from lmkit.api.attention import AttentionMetadata  # noqa: E402
from lmkit.api.model import ForwardContext  # noqa: E402
from lmkit.worker.cuda_graphs import CudaGraphRunner, capture_sizes  # noqa: E402
from lmkit.worker.input_batch import CachedRequestState, InputBatch  # noqa: E402

CPU = torch.device("cpu")


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert sizes == sorted(set(sizes))
    assert capture_sizes(2000)[-1] == 512
    # from 32 requests on, padding adds at most a quarter
    steps = [(a, b) for a, b in zip(sizes, sizes[1:], strict=False) if a >= 32]
    assert steps and all(b / (a + 1) <= 1.25 for a, b in steps)


def _decode_step(context_lens):
    """A decode step for requests with these contexts (block ids spread over the pool)."""
    batch = InputBatch(8, 256, BLOCK, 64)
    rng = np.random.default_rng(0)
    for i, ctx in enumerate(context_lens):
        tokens = rng.integers(0, 256, ctx + 1).tolist()
        state = CachedRequestState(str(i), tokens, [], None, None, None, ctx)
        num_blocks = -(-(ctx + 1) // BLOCK)
        batch.add_request(state, [1 + 10 * i + j for j in range(num_blocks)])
    n = len(context_lens)
    return batch.prepare(np.arange(n), np.ones(n, dtype=np.int64), n)


def _eager(model, step, caches):
    md = AttentionMetadata(
        num_reqs=step.num_reqs, num_actual_tokens=step.num_tokens, max_query_len=1,
        max_seq_len=int(step.seq_lens.max()), query_start_loc=step.query_start_loc,
        seq_lens=step.seq_lens, block_tables=step.block_tables,
        slot_mapping=step.slot_mapping, query_start_loc_cpu=step.query_start_loc,
        seq_lens_cpu=step.seq_lens, num_decodes=step.num_reqs)
    model.attn.plan(md)
    return model(step.input_ids, step.positions, ForwardContext(model.attn, caches))


@pytest.mark.parametrize("model_fixture", ["tiny_model", "tiny_deepseek"])
@pytest.mark.parametrize("context_lens", [[5], [40, 3, 17], [0, 33, 15, 64, 2]])
def test_padded_decode_matches_eager(model_fixture, context_lens, request):
    model = request.getfixturevalue(model_fixture)
    caches, eager_caches = random_caches(model)
    step = _decode_step(context_lens)
    with torch.inference_mode():
        expected = _eager(model, step, eager_caches)
        runner = CudaGraphRunner(model, caches, CPU, max_num_seqs=8, max_model_len=256,
                                 block_size=BLOCK, use_graphs=False)
        assert runner.can_replay(step)
        padded = runner.padded_size(len(context_lens))
        assert padded >= len(context_lens) and padded in runner.sizes
        actual = runner.replay(step)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    # the same slots written, padding wrote nothing (a stray write would replace a random
    # value by an unrelated one); written values agree to rounding: a padded batch may
    # round differently (DeepSeek's MoE layers see 4 rows instead of 3)
    for got, want in zip(caches, eager_caches, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_prefill_steps_are_not_replayed(tiny_model):  # noqa: F811 (the fixture)
    batch = InputBatch(4, 128, BLOCK, 64)
    state = CachedRequestState("p", list(range(10)), [], None, None, None, 0)
    batch.add_request(state, [1])
    step = batch.prepare(np.arange(1), np.array([10]), 0)
    runner = CudaGraphRunner(tiny_model, [], CPU, max_num_seqs=4, max_model_len=128,
                             block_size=BLOCK, use_graphs=False)
    assert not runner.can_replay(step)
