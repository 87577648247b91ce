"""Speculative verification steps replayed through the decode graphs, flattened, on the CPU.

:class:`CudaGraphRunner` runs a step with ``1 + k`` query tokens per request as one
decode row per token (``seq_len = position + 1``, the request's block table repeated).
With ``use_graphs=False`` it runs that padded, fixed-buffer forward eagerly, so here --
a tiny Llama with the ``torch`` attention backend -- the flattened forward must give the
normal eager forward's hidden states, greedy tokens and KV cache, and a model runner
driven by the real scheduler must produce the same greedy tokens with drafts as without.

The torch backend writes the cache with ``index_copy_``, which has no "skip" for the
padding rows' slot ``-1``; :class:`ScratchSlotTorchAttention` sends those writes to slot
0 of the null block 0, which no request ever owns (the triton and flashinfer kernels
skip ``-1`` themselves).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lmkit.api.attention import AttentionMetadata
from lmkit.api.model import ForwardContext
from lmkit.api.request import Request
from lmkit.api.sampling_params import SamplingParams
from lmkit.config.schema import LMKitConfig
from lmkit.loading.model_facts import load_model_facts
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import resolve_stack
from lmkit.testing.tiny_model import load_tiny_model, make_tiny_model
from lmkit.worker.cuda_graphs import CudaGraphRunner
from lmkit.worker.input_batch import CachedRequestState, InputBatch
from lmkit.worker.model_runner import ModelRunner
from lmkit_plugins.attention.torch_ref import TorchAttention
from lmkit_plugins.models.llama import LlamaForCausalLM

BLOCK = 8
CPU = torch.device("cpu")


class ScratchSlotTorchAttention(TorchAttention):
    """The torch reference with padding rows' cache writes (slot -1) sent to slot 0."""

    def plan(self, metadata: AttentionMetadata) -> None:
        super().plan(metadata)
        self._plan.slot_mapping = self._plan.slot_mapping.clamp(min=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-spec-graphs"), num_layers=2,
                           hidden_size=64, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_tiny_model(model_dir, LlamaForCausalLM, ScratchSlotTorchAttention,
                           block_size=BLOCK)


def _verification_step(contexts, num_drafts):
    """Requests with these computed contexts, each running its last known token plus
    ``num_drafts[i]`` drafts (0: a plain decode); blocks 1.. spread over the pool."""
    batch = InputBatch(8, 256, BLOCK, 256)
    rng = np.random.default_rng(0)
    for i, (ctx, k) in enumerate(zip(contexts, num_drafts, strict=True)):
        state = CachedRequestState(str(i), rng.integers(0, 256, ctx + 1).tolist(), [], None,
                                   None, None, ctx)
        num_blocks = -(-(ctx + 1 + k) // BLOCK)
        batch.add_request(state, [1 + 12 * i + j for j in range(num_blocks)])
        batch.write_draft_tokens(i, rng.integers(0, 256, k).tolist())
    n = len(contexts)
    num_scheduled = np.asarray(num_drafts, dtype=np.int64) + 1
    num_decodes = int(np.argmax(num_scheduled > 1)) if (num_scheduled > 1).any() else n
    return batch.prepare(np.arange(n), num_scheduled, num_decodes)


def _eager(model, step, caches):
    """The model runner's eager forward (multi-token queries as one prefill group)."""
    md = step.attention_metadata()
    model.attn.plan(md)
    return model(step.input_ids, step.positions, ForwardContext(model.attn, caches))


def test_captured_sizes_cover_verification_steps(model):
    runner = CudaGraphRunner(model, [], CPU, max_num_seqs=4, max_model_len=256,
                             block_size=BLOCK, use_graphs=False, max_query_len=5)
    assert runner.max_bs == 20 and runner.padded_size(17) == 20
    assert runner.can_replay(_verification_step([9, 30, 3, 12], [4, 4, 4, 4]))  # 20 tokens
    assert not runner.can_replay(_verification_step([9], [5]))  # 6 query tokens
    plain = CudaGraphRunner(model, [], CPU, max_num_seqs=4, max_model_len=256,
                            block_size=BLOCK, use_graphs=False)
    assert plain.max_bs == 4 and not plain.can_replay(_verification_step([9], [1]))


@pytest.mark.parametrize("contexts,num_drafts", [
    ([12], [4]),  # batch 1: 5 tokens, padded to 8
    ([5, 40, 17], [0, 3, 4]),  # a plain decode first, drafts crossing block boundaries
    ([0, 33, 15, 64, 2, 7], [2, 4, 0, 1, 4, 3]),  # decode-like rows in any order
])
def test_flattened_forward_matches_eager(model, contexts, num_drafts):
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(model.attn.kv_cache_shape(96), generator=g) for _ in range(2)]
    eager_caches = [c.clone() for c in caches]
    step = _verification_step(contexts, num_drafts)
    with torch.inference_mode():
        expected = _eager(model, step, eager_caches)
        runner = CudaGraphRunner(model, caches, CPU, max_num_seqs=8, max_model_len=256,
                                 block_size=BLOCK, use_graphs=False, max_query_len=5)
        assert runner.can_replay(step)
        actual = runner.replay(step)
        assert runner.num_replays == 1 and runner.num_flattened_replays == 1
        assert actual.shape == expected.shape == (sum(num_drafts) + len(contexts), 64)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(model.compute_logits(actual).argmax(-1),
                           model.compute_logits(expected).argmax(-1))
    for got, want in zip(caches, eager_caches, strict=True):
        # the same slots written; padding only touched the null block 0
        torch.testing.assert_close(got[:, 1:], want[:, 1:], atol=1e-5, rtol=0)


def test_flattened_forward_returns_the_draft_heads_layer_inputs(model):
    """EAGLE-3 reads the inputs of chosen target layers: the graph runner returns them
    beside the hidden states, equal to the eager forward's, one row per step token."""
    g = torch.Generator().manual_seed(2)
    caches = [torch.randn(model.attn.kv_cache_shape(96), generator=g) for _ in range(2)]
    eager_caches = [c.clone() for c in caches]
    step = _verification_step([5, 40, 17], [0, 3, 4])
    with torch.inference_mode():
        md_ctx = ForwardContext(model.attn, eager_caches, (0, 1))
        _eager(model, step, eager_caches)  # plans; the forward below reuses that plan
        model(step.input_ids, step.positions, md_ctx)
        expected = md_ctx.aux_hidden_states
        runner = CudaGraphRunner(model, caches, CPU, max_num_seqs=8, max_model_len=256,
                                 block_size=BLOCK, use_graphs=False, max_query_len=5,
                                 aux_layers=(0, 1))
        aux: list[torch.Tensor] = []
        runner.replay(step, aux)
    assert len(aux) == 2 and aux[0].shape == (step.num_tokens, 64)
    for got, want in zip(aux, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(aux[0], aux[1])


# ---------------------------------------------------------------- the model runner


def _run(model_dir, graphs: bool, oracle=None, k=4):
    """Greedy generation by a ModelRunner + the fcfs scheduler; with ``oracle``, each
    decoding request gets ``k`` drafts per step: the expected continuation with every
    third draft position wrong (so both accepted runs and rejections occur)."""
    config = LMKitConfig.model_validate({
        "model": {"model": str(model_dir), "dtype": "float32", "max_model_len": 256},
        "cache": {"block_size": BLOCK, "num_blocks": 96},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64},
        "attention": {"backend": "torch"}, "executor": {"device": "cpu"},
        "structured_output": {"backend": "none"},
    })
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    runner = ModelRunner(config, resolve_stack(config, host), host, load_model_facts(model_dir, host))
    runner.load_model()
    runner.model.attn.__class__ = ScratchSlotTorchAttention
    runner.initialize_kv_cache(96)
    if graphs:
        runner.cuda_graphs = CudaGraphRunner(runner.model, runner.kv_caches, CPU, 4,
                                             runner.max_model_len, BLOCK, use_graphs=False,
                                             max_query_len=1 + k)
    scheduler = host.registry.get("scheduler", "fcfs").spec.load()(config, num_blocks=96,
                                                                    options=None)
    requests = {}
    for rid, n, m in (("0", 5, 30), ("1", 21, 12), ("2", 9, 25)):
        prompt = [(7 * int(rid) + 3 * i) % 256 for i in range(n)]
        requests[rid] = Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=m,
                                                           ignore_eos=True))
        scheduler.add_request(requests[rid])
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    step = 0
    while scheduler.has_unfinished_requests():
        if step == 6:  # an arrival mid-run: a prefill next to verifications (eager)
            requests["3"] = Request("3", list(range(40, 58)), SamplingParams(
                temperature=0.0, max_tokens=10, ignore_eos=True))
            scheduler.add_request(requests["3"])
            tokens["3"] = []
        if oracle is not None:
            for rid, r in requests.items():
                done = len(r.output_token_ids)
                if not r.is_finished and done and r.num_computed_tokens == r.num_tokens - 1:
                    want = oracle[rid][done:done + k]
                    r.spec_token_ids = [(t + 1) % 256 if (done + j) % 3 == 2 else t
                                        for j, t in enumerate(want)][:r.max_tokens - done - 1]
        so = scheduler.schedule()
        out = runner.execute_model(so)
        for eo in scheduler.update_from_output(so, out):
            tokens[eo.request_id].extend(eo.new_token_ids)
        step += 1
    return tokens, runner


@pytest.fixture(scope="module")
def plain_tokens(model_dir):
    tokens, _ = _run(model_dir, graphs=False)
    assert {r: len(t) for r, t in tokens.items()} == {"0": 30, "1": 12, "2": 25, "3": 10}
    return tokens


@pytest.mark.parametrize("graphs", [False, True])
def test_runner_with_drafts_gives_the_plain_tokens(model_dir, plain_tokens, graphs):
    tokens, runner = _run(model_dir, graphs=graphs, oracle=plain_tokens)
    assert tokens == plain_tokens
    if graphs:  # verification steps went through the graph runner
        assert runner.cuda_graphs.num_flattened_replays >= 5
