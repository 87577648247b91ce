"""Short steps (prefills, mixed steps) replayed through the decode graphs flattened.

:class:`CudaGraphRunner` with ``flat_tokens`` takes a step of at most that many tokens
whatever its query lengths, one decode row per token (:mod:`lmkit.worker.flat_steps`).
With ``use_graphs=False`` it runs that padded, flattened forward without capturing, so
here -- a tiny Llama on the ``triton`` backend and a tiny DeepSeek-V3 on ``mla_triton``,
in Triton's interpreter -- it must give the eager forward's hidden states (the prefill
attention path) and write the same KV. The rule that picks such steps is checked on its
own: the token limit, the K/V reads after a long cached prefix, encoders left out.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: the graph path is tested in tests/gpu")
torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from graph_models import BLOCK, random_caches, tiny_deepseek, tiny_model  # noqa: E402, F401
from lmkit.api.model import ForwardContext  # noqa: E402
from lmkit.worker.cuda_graphs import CudaGraphRunner  # noqa: E402
from lmkit.worker.flat_steps import (  # noqa: E402
    FLAT_READS_PER_TOKEN,
    fits_flat,
    flat_step_tokens,
    flattened_reads,
)
from lmkit.worker.input_batch import CachedRequestState, InputBatch  # noqa: E402

CPU = torch.device("cpu")


def test_flattened_reads_counts_each_rows_prefix():
    # 3 tokens after 10 computed: 11 + 12 + 13; a decode after 4: 5
    assert flattened_reads(np.array([3, 1]), np.array([10, 4])) == 36 + 5
    assert flattened_reads(np.array([5]), np.array([0])) == 15


def test_fits_flat_bounds_tokens_and_reads():
    assert fits_flat(64, np.array([20]), np.array([0]))
    assert fits_flat(64, np.array([1, 1, 30]), np.array([500, 80, 16]))
    assert not fits_flat(64, np.array([40, 30]), np.array([0, 0]))  # 70 tokens
    assert not fits_flat(0, np.array([2]), np.array([0]))  # off
    # 8 tokens after a long cached prefix read more than the limit per token
    long = FLAT_READS_PER_TOKEN * 2
    assert not fits_flat(64, np.array([8]), np.array([long]))
    assert fits_flat(64, np.array([8]), np.array([FLAT_READS_PER_TOKEN - 8]))
    # decodes read their long contexts in any decode step: only the prompt's rows count
    assert fits_flat(64, np.array([1] * 40 + [10]), np.array([5000] * 40 + [0]))


def test_encoders_take_no_short_steps():
    def model(*causal):
        groups = tuple(SimpleNamespace(attn=SimpleNamespace(causal=c)) for c in causal)
        return SimpleNamespace(kv_cache_groups=lambda n: groups)

    assert flat_step_tokens(64, model(True), 2) == 64
    assert flat_step_tokens(64, model(True, False), 2) == 0
    assert flat_step_tokens(64, SimpleNamespace(kv_cache_groups=lambda n: (
        SimpleNamespace(attn=object()),)), 2) == 64  # a backend without the attribute


def _step(requests):
    """A step of ``(computed, scheduled)`` requests, decodes (1 scheduled) first."""
    batch = InputBatch(8, 256, BLOCK, 128)
    rng = np.random.default_rng(0)
    for i, (computed, scheduled) in enumerate(requests):
        tokens = rng.integers(0, 256, computed + scheduled).tolist()
        state = CachedRequestState(str(i), tokens, [], None, None, None, computed)
        num_blocks = -(-(computed + scheduled) // BLOCK)
        batch.add_request(state, [1 + 12 * i + j for j in range(num_blocks)])
    scheduled = np.array([s for _, s in requests], dtype=np.int64)
    num_decodes = int(np.argmax(scheduled != 1)) if (scheduled != 1).any() else len(scheduled)
    return batch.prepare(np.arange(len(requests)), scheduled, num_decodes)


@pytest.mark.parametrize("model_fixture", ["tiny_model", "tiny_deepseek"])
@pytest.mark.parametrize("requests", [
    [(0, 20)],  # a prompt
    [(30, 9)],  # a prompt's tail after a cached prefix
    [(40, 1), (3, 1), (0, 17), (16, 12)],  # decodes, then two prefill chunks
])
def test_short_step_replayed_flattened_matches_eager(model_fixture, requests, request):
    model = request.getfixturevalue(model_fixture)
    caches, eager_caches = random_caches(model)
    step = _step(requests)
    with torch.inference_mode():
        model.attn.plan(step.attention_metadata())
        expected = model(step.input_ids, step.positions, ForwardContext(model.attn, eager_caches))
        runner = CudaGraphRunner(model, caches, CPU, max_num_seqs=1, max_model_len=256,
                                 block_size=BLOCK, use_graphs=False, flat_tokens=64)
        assert runner.max_bs >= step.num_tokens  # captured up to flat_tokens
        assert runner.can_replay(step)
        actual = runner.replay(step)
    assert runner.num_flattened_replays == 1
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    for got, want in zip(caches, eager_caches, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_long_or_off_steps_are_not_flattened(tiny_model):  # noqa: F811 (the fixture)
    def runner(flat):
        return CudaGraphRunner(tiny_model, [], CPU, max_num_seqs=2, max_model_len=4096,
                               block_size=BLOCK, use_graphs=False, flat_tokens=flat)

    assert runner(0).max_bs == 2 and not runner(0).can_replay(_step([(0, 10)]))
    assert runner(16).can_replay(_step([(0, 10)]))
    assert not runner(16).can_replay(_step([(0, 17)]))  # more tokens than the limit
    assert runner(16).can_replay(_step([(1, 1), (2, 1)]))  # decodes as before
