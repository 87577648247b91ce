"""Decode steps launched ahead of the scheduler (:mod:`lmkit.worker.gpu_lookahead`), on
the CPU: the runner with the padded decode path (``CudaGraphRunner(use_graphs=False)``,
the ``triton`` backend in Triton's interpreter) driven by the real FCFS scheduler.

With the lookahead on, every request must get exactly the tokens it gets with the
lookahead off, while requests finish at different steps (the prediction is used for
the survivors), a request arrives mid-run (the prediction is discarded) and requests
cross block boundaries (no slot yet: nothing is launched ahead).
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: the lookahead runs in tests/gpu")
torch = pytest.importorskip("torch")

from lmkit.api.request import Request  # noqa: E402
from lmkit.api.sampling_params import SamplingParams  # noqa: E402
from lmkit.api.scheduler import SchedulerContext  # noqa: E402
from lmkit.config.schema import LMKitConfig  # noqa: E402
from lmkit.loading.model_facts import load_model_facts  # noqa: E402
from lmkit.plugin_host.manager import PluginHost  # noqa: E402
from lmkit.plugin_host.resolve import resolve_stack  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402
from lmkit.worker.cuda_graphs import CudaGraphRunner  # noqa: E402
from lmkit.worker.gpu_lookahead import DecodeLookahead  # noqa: E402
from lmkit.worker.model_runner import ModelRunner  # noqa: E402

NUM_BLOCKS = 64
BLOCK = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), num_layers=1, hidden_size=64,
                           num_heads=4, num_kv_heads=2)


# random sampling the launched step draws with the runner's sampler, filtered down to
# the argmax (top-k 1, a tiny top-p): the same tokens as greedy decoding
SAMPLED = {"0": dict(temperature=0.8, top_k=1), "2": dict(temperature=1.3, top_p=1e-6)}
# requests whose kept tensors (penalty counts, bias, allowed ids) shape the launched draw
ADJUSTED = {"0": dict(temperature=0.0, repetition_penalty=1.6, presence_penalty=0.8),
            "1": dict(temperature=0.8, top_k=1, frequency_penalty=1.5),
            "2": dict(temperature=0.0, logit_bias={40: 3.0, 41: 2.5}),
            "3": dict(temperature=0.0, allowed_token_ids=list(range(30, 90)),
                      repetition_penalty=0.7)}


def _params(rid: str, sampling: str, max_tokens: int) -> SamplingParams:
    kw: dict = dict(temperature=0.0)
    if sampling == "seeded":  # really random: only the seed makes the tokens repeat
        kw = dict(temperature=1.0, seed=100 + int(rid))
    elif sampling == "sampled":
        kw = SAMPLED.get(rid, kw)
    elif sampling == "adjusted":
        kw = ADJUSTED.get(rid, kw)
    return SamplingParams(**kw, max_tokens=max_tokens, ignore_eos=True)


def _run(model_dir, lookahead: bool, slots: int = 0, sampling: str = "greedy"):
    config = LMKitConfig.model_validate({
        "model": {"model": str(model_dir), "dtype": "float32", "max_model_len": 256},
        "cache": {"block_size": BLOCK, "num_blocks": NUM_BLOCKS},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256},
        "attention": {"backend": "torch"}, "executor": {"device": "cpu"},
        "structured_output": {"backend": "none"},
    })
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    stack = resolve_stack(config, host)
    stack.entries["attention"] = host.registry.get("attention", "triton")  # interpreted
    stack.options["attention"] = None
    runner = ModelRunner(config, stack, host, load_model_facts(model_dir, host))
    runner.load_model()
    runner.initialize_kv_cache(NUM_BLOCKS)
    runner.cuda_graphs = CudaGraphRunner(runner.model, runner.kv_caches, runner.device,
                                         8, runner.max_model_len, BLOCK, use_graphs=False)
    runner.lookahead = DecodeLookahead(runner.cuda_graphs, runner.model, runner.input_batch,
                                       runner.requests, runner.max_model_len,
                                       sampler=runner.sampler) if lookahead else None
    scheduler = host.registry.get("scheduler", "fcfs").spec.load()(  # as the engine on CUDA
        config, num_blocks=NUM_BLOCKS, options=None,
        context=SchedulerContext(num_lookahead_slots=slots))

    def request(rid, prompt_len, max_tokens):
        prompt = [(7 * int(rid) + 3 * i) % 256 for i in range(prompt_len)]
        params = _params(rid, sampling, max_tokens)
        return Request(rid, prompt, params)

    for rid, n, m in (("0", 5, 24), ("1", 14, 7), ("2", 30, 16)):
        scheduler.add_request(request(rid, n, m))
    tokens: dict[str, list[int]] = {}
    step = 0
    while scheduler.has_unfinished_requests():
        if step in (10, 11, 12):  # arrivals mid-run
            scheduler.add_request(request(str(step - 7), 9, 8))
        so = scheduler.schedule()
        out = runner.execute_model(so)
        for eo in scheduler.update_from_output(so, out):
            tokens.setdefault(eo.request_id, []).extend(eo.new_token_ids)
        step += 1
    return tokens, runner.lookahead


@pytest.fixture(scope="module")
def expected(model_dir):
    tokens, _ = _run(model_dir, lookahead=False)
    assert {r: len(t) for r, t in tokens.items()} == {"0": 24, "1": 7, "2": 16, "3": 8,
                                                       "4": 8, "5": 8}
    return tokens


@pytest.mark.parametrize("slots", [0, 1])
def test_lookahead_gives_the_same_tokens(model_dir, expected, slots):
    actual, lookahead = _run(model_dir, lookahead=True, slots=slots)
    assert actual == expected
    stats = lookahead.stats
    print(stats)
    assert stats.discarded >= 1  # an arrival
    assert stats.launched >= stats.used + stats.discarded
    # with a reserved slot the next block is always there: more steps come from the
    # prediction than when each block boundary interrupts it
    assert stats.used >= (15 if slots else 8)


def test_unseeded_random_requests_are_launched_ahead_with_the_sampler(model_dir, expected):
    """Requests sampling at random (filtered to the argmax here, so the tokens are
    known) beside greedy ones: their steps are launched ahead, the launched step drawing
    with the runner's sampler, and every request gets its tokens."""
    actual, lookahead = _run(model_dir, lookahead=True, slots=1, sampling="sampled")
    assert actual == expected
    assert lookahead.stats.used >= 15


def test_seeded_requests_draw_the_same_tokens_launched_ahead(model_dir):
    """Seeded random requests are launched ahead too: a launched step that is not taken
    (an arrival discards it, a request that finished leaves it) rewinds the generators
    it drew from, so every request gets the tokens of the run without the lookahead."""
    expected, _ = _run(model_dir, lookahead=False, sampling="seeded")
    actual, lookahead = _run(model_dir, lookahead=True, slots=1, sampling="seeded")
    assert actual == expected
    assert lookahead.stats.used >= 15 and lookahead.stats.discarded >= 1


def test_penalties_bias_and_allowed_ids_are_launched_ahead(model_dir):
    """Penalties, logit bias and allowed ids in steps launched ahead: the launched draw
    counts the token the step before drew (still on the device) with the request's
    kept counts, so every request gets the tokens of the run without the lookahead."""
    expected, _ = _run(model_dir, lookahead=False, sampling="adjusted")
    actual, lookahead = _run(model_dir, lookahead=True, slots=1, sampling="adjusted")
    assert actual == expected
    assert lookahead.stats.used >= 15


def test_launched_steps_take_the_sampling_kernels_argmax(model_dir, expected, monkeypatch):
    """Greedy steps launched ahead take the argmax of the runner's sampling kernels
    (:meth:`lmkit.api.SamplingKernels.argmax`, which a plugin may replace; on CUDA the
    ``triton`` kernels' chunked argmax), once per launched step, with the tokens of the
    run without the lookahead."""
    from lmkit.api import SamplingKernels

    calls = []
    original = SamplingKernels.argmax

    def argmax(self, logits):
        calls.append(logits.shape[0])
        return original(self, logits)

    monkeypatch.setattr(SamplingKernels, "argmax", argmax)
    actual, lookahead = _run(model_dir, lookahead=True, slots=1)
    assert actual == expected
    assert lookahead.stats.launched > 15 and len(calls) == lookahead.stats.launched
