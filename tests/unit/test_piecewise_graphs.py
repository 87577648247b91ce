"""Piecewise CUDA graphs (mixed prefill+decode steps), their padded path on the CPU.

:class:`PiecewiseGraphRunner` pads a step of ``n`` tokens to a captured size and runs
the model from fixed buffers, its attention calls on the step's first ``n`` tokens only.
With ``use_graphs=False`` it does exactly that without capturing, so here -- a tiny
Llama with the ``triton`` backend (the model writes K/V in its RoPE path) and with
``torch`` (the backend writes them), and a tiny DeepSeek-V3 with ``mla_triton``
(``run_mla``), in Triton's interpreter -- the padded forward of a mixed step must give
the eager forward's hidden states and leave the KV cache as the eager step does
(padding rows write nothing). On CUDA the pieces are captured and replayed
(tests/gpu/test_piecewise_graphs_gpu.py).
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: the graph path is tested in tests/gpu")
torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from lmkit.api.model import ForwardContext  # noqa: E402
from lmkit.config import load_config  # noqa: E402
from lmkit.errors import ConfigError  # noqa: E402
from lmkit.testing.tiny_model import (  # noqa: E402
    load_tiny_model,
    make_tiny_deepseek,
    make_tiny_model,
)
from lmkit.worker.input_batch import CachedRequestState, InputBatch  # noqa: E402
from lmkit.worker.piecewise_graphs import (  # noqa: E402
    PiecewiseGraphRunner,
    PiecewiseUnsupportedError,
    maybe_capture_piecewise,
    piecewise_sizes,
)
from lmkit_plugins.attention.mla_triton import MLATritonAttention  # noqa: E402
from lmkit_plugins.attention.torch_ref import TorchAttention  # noqa: E402
from lmkit_plugins.attention.triton_backend import TritonAttention  # noqa: E402
from lmkit_plugins.models.deepseek import DeepseekV3ForCausalLM  # noqa: E402
from lmkit_plugins.models.llama import LlamaForCausalLM  # noqa: E402

BLOCK = 16
CPU = torch.device("cpu")


def test_piecewise_sizes():
    assert piecewise_sizes(0) == []
    assert piecewise_sizes(10) == [10]
    sizes = piecewise_sizes(2048)
    assert sizes[:4] == [16, 32, 64, 128] and sizes[-1] == 2048
    assert sizes == sorted(set(sizes))
    # above 128 tokens padding adds at most a quarter
    steps = [(a, b) for a, b in zip(sizes, sizes[1:], strict=False) if a >= 128]
    assert steps and all(b / (a + 1) <= 1.25 for a, b in steps)
    assert piecewise_sizes(100)[-1] == 100  # the limit itself is always a size


def _llama(tmp_path_factory, attention_cls):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), num_layers=2, hidden_size=64,
                           num_heads=4, num_kv_heads=2)
    return load_tiny_model(path, LlamaForCausalLM, attention_cls, block_size=BLOCK)


@pytest.fixture(scope="module")
def tiny_triton(tmp_path_factory):
    return _llama(tmp_path_factory, TritonAttention)


@pytest.fixture(scope="module")
def tiny_torch(tmp_path_factory):
    return _llama(tmp_path_factory, TorchAttention)


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    pytest.importorskip("transformers")
    path = make_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek"), 3)
    return load_tiny_model(path, DeepseekV3ForCausalLM, MLATritonAttention, block_size=BLOCK)


def _mixed_step(context_lens, prompt_len):
    """Decodes for requests with these contexts, then a prefill chunk of ``prompt_len``
    tokens of a new request (block ids spread over the pool)."""
    batch = InputBatch(8, 256, BLOCK, 512)
    rng = np.random.default_rng(0)
    for i, ctx in enumerate([*context_lens, 0]):
        tokens = rng.integers(0, 256, (ctx + 1) if i < len(context_lens) else prompt_len)
        state = CachedRequestState(str(i), tokens.tolist(), [], None, None, None, ctx)
        num_blocks = -(-max(ctx + 1, len(tokens)) // BLOCK)
        batch.add_request(state, [1 + 10 * i + j for j in range(num_blocks)])
    n = len(context_lens)
    scheduled = np.array([1] * n + [prompt_len], dtype=np.int64)
    return batch.prepare(np.arange(n + 1), scheduled, n)


def _plan(model, step):
    model.attn.plan(step.attention_metadata())


@pytest.mark.parametrize("model_fixture", ["tiny_triton", "tiny_torch", "tiny_deepseek"])
@pytest.mark.parametrize(("context_lens", "prompt_len"), [([40, 3], 9), ([17], 30)])
def test_padded_mixed_step_matches_eager(model_fixture, context_lens, prompt_len, request):
    model = request.getfixturevalue(model_fixture)
    shape = model.attn.kv_cache_shape(64)
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(shape, generator=g) for _ in range(model.dims.num_layers)]
    eager_caches = [c.clone() for c in caches]
    step = _mixed_step(context_lens, prompt_len)
    n = step.num_tokens
    with torch.inference_mode():
        _plan(model, step)
        expected = model(step.input_ids, step.positions, ForwardContext(model.attn, eager_caches))
        runner = PiecewiseGraphRunner(model, caches, CPU, max_tokens=64, use_graphs=False)
        assert runner.can_run(n) and not runner.can_run(65) and not runner.can_run(0)
        size = runner.padded_size(n)
        assert size > n  # the step is padded: rows n..size must not leak into it
        # stale values where padding rows read (an earlier, larger step's slots)
        runner._packed.fill_(7)
        _plan(model, step)
        actual = runner.run(step, n)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    # the same slots written; padding rows wrote nothing (a stray write at slot 7 or
    # any other would replace a random value by an unrelated one)
    for got, want in zip(caches, eager_caches, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert runner.num_replays == 1
    # what a model writing K/V in its own kernels (CUDA) reads: the step's slots, then
    # -1 (no write) for every padding row, token 0 at position 0 there
    slots = runner.slots(size)
    assert slots[:n].tolist() == step.slot_mapping.tolist()
    assert (slots[n:] == -1).all()
    assert (runner._packed[:size][n:] == 0).all() and (runner._packed[size:2 * size][n:] == 0).all()


def test_aux_layers_come_back_for_the_step_tokens(tiny_triton):
    model = tiny_triton
    caches = [torch.zeros(model.attn.kv_cache_shape(64)) for _ in range(2)]
    step = _mixed_step([5], 12)
    with torch.inference_mode():
        _plan(model, step)
        ctx = ForwardContext(model.attn, [c.clone() for c in caches], (0, 1))
        model(step.input_ids, step.positions, ctx)
        runner = PiecewiseGraphRunner(model, caches, CPU, max_tokens=32, use_graphs=False,
                                      aux_layers=(0, 1))
        _plan(model, step)
        aux: list = []
        runner.run(step, step.num_tokens, aux)
    assert len(aux) == 2
    for got, want in zip(aux, ctx.aux_hidden_states, strict=True):
        assert got.shape == (step.num_tokens, model.dims.hidden_size)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class _AsksForMore(torch.nn.Module):
    """A model that calls a backend method no graph can be split around."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, input_ids, positions, ctx):
        ctx.attn.paged_decode_args()
        return input_ids


def test_a_model_using_other_backend_methods_is_refused(tiny_torch):
    runner = PiecewiseGraphRunner(_AsksForMore(tiny_torch.attn), [], CPU, max_tokens=16,
                                  use_graphs=False)
    step = _mixed_step([], 4)
    _plan(tiny_torch, step)
    with pytest.raises(PiecewiseUnsupportedError, match=r"paged_decode_args\(\).*run\(\)"):
        runner.run(step, step.num_tokens)


class _ChecksItsBackend(torch.nn.Module):
    """A model whose forward insists on the backend's type (the contract says not to)."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, input_ids, positions, ctx):
        if not isinstance(ctx.attn, TorchAttention):
            raise TypeError("expected a TorchAttention")
        return input_ids


@pytest.mark.parametrize("model_cls", [_AsksForMore, _ChecksItsBackend])
def test_a_warm_up_failure_keeps_mixed_steps_eager(tiny_torch, model_cls):
    """What the capture runs first, before any graph: a model that fails beside the
    stand-in is refused there with the reason (then its mixed steps run eagerly)."""
    runner = PiecewiseGraphRunner(model_cls(tiny_torch.attn), [], CPU, max_tokens=16,
                                  use_graphs=False)
    with pytest.raises(PiecewiseUnsupportedError, match=r"paged_decode_args|TypeError"):
        runner.warm_up(16)


def test_not_captured_off_cuda_or_when_off(tiny_torch):
    cfg, _ = load_config(None, cli={"model.model": "x"}, env={})
    assert cfg.executor.piecewise_max_tokens == 2048
    assert maybe_capture_piecewise(cfg, tiny_torch, [], CPU, 1) is None
    with pytest.raises(ConfigError, match="piecewise_max_tokens"):
        load_config(None, cli={"model.model": "x", "executor.piecewise_max_tokens": -1},
                    env={})


@pytest.mark.parametrize(("kwargs", "env", "reason"), [
    ({"tp_size": 2}, None, "tensor parallelism"),
    ({"num_kv_groups": 2}, None, "one KV cache group"),
    ({}, "0", None),
])
def test_when_piecewise_graphs_stay_off(tiny_torch, monkeypatch, caplog, kwargs, env, reason):
    """The checks before any capture (they run on a CUDA device object without touching
    the device)."""
    cfg, _ = load_config(None, cli={"model.model": "x"}, env={})
    if env is not None:
        monkeypatch.setenv("LMKIT_PIECEWISE_GRAPHS", env)
    args = {"num_kv_groups": 1, **kwargs}
    with caplog.at_level("INFO", logger="lmkit.worker.piecewise_graphs"):
        got = maybe_capture_piecewise(cfg, tiny_torch, [], torch.device("cuda"),
                                      args.pop("num_kv_groups"), **args)
    assert got is None
    if reason is not None:
        assert reason in caplog.text


@pytest.mark.parametrize("model_fixture", ["tiny_triton", "tiny_torch", "tiny_deepseek"])
def test_warm_up_never_calls_the_backend_and_sizes_buffers_as_it_answers(
        model_fixture, request, monkeypatch):
    """Before a capture the runner runs each size once without the backend (no plan:
    any backend takes part): the output buffers it makes must have the shape and dtype
    the backend's real answer has, or replays could not copy into them."""
    model = request.getfixturevalue(model_fixture)
    method = "run_mla" if model_fixture == "tiny_deepseek" else "run"
    answers = []
    real = getattr(model.attn, method)

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        answers.append((tuple(out.shape[1:]), out.dtype))
        return out

    monkeypatch.setattr(model.attn, method, spy)
    caches = [torch.randn(model.attn.kv_cache_shape(64)) for _ in range(model.dims.num_layers)]
    before = [c.clone() for c in caches]
    runner = PiecewiseGraphRunner(model, caches, CPU, max_tokens=32, use_graphs=False)
    with torch.inference_mode():
        runner._stage_padding_only(32)
        hidden, _, calls = runner._run_model(32, 32, "warm")
        assert answers == [] and calls == []  # no backend call, nothing recorded
        assert hidden.shape == (32, model.dims.hidden_size) and torch.isfinite(hidden).all()
        for got, want in zip(caches, before, strict=True):
            assert torch.equal(got, want)  # the warm-up wrote no cache entry
        step = _mixed_step([5], 12)
        _plan(model, step)
        runner.run(step, step.num_tokens)
    assert len(answers) == model.dims.num_layers
    outs = {(key[2], key[3]) for key in runner._buffers if key[:2] == (method, "out")}
    assert outs == set(answers)
