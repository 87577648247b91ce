"""The draft runner's host-side shortcuts: index arrays staged to the device in one
buffer per dtype (:class:`lmkit.worker.staging.StepStaging`); greedy drafts taken with
``RunnerProposer.draft_argmax`` (EAGLE-3: over its draft vocabulary, then mapped) equal
to the argmax of the full logits, ties included; and a decode-like catch-up pass run
flattened through the padded graph path (``use_graphs=False``) giving the eager pass's
drafts and head KV cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lmkit.api import DraftHeadContext, LMKitConfig, ModelBuildContext
from lmkit.loading.weights import iterate_weights, load_hf_config
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head
from lmkit.testing.tiny_model import make_tiny_model
from lmkit.worker.draft_graphs import DraftPassGraphs
from lmkit.worker.draft_runner import DraftRunner
from lmkit.worker.input_batch import CachedRequestState, InputBatch
from lmkit.worker.staging import StepStaging
from lmkit_plugins.attention.torch_ref import TorchAttention
from lmkit_plugins.models.llama import LlamaForCausalLM
from lmkit_plugins.spec.eagle import EagleProposer
from lmkit_plugins.spec.eagle3 import Eagle3Proposer

CPU = torch.device("cpu")
BLOCK, K = 4, 3


class ScratchSlotTorchAttention(TorchAttention):
    """The torch reference with padding rows' cache writes (slot -1) sent to the null
    block 0 (the triton and flashinfer kernels skip them)."""

    def plan(self, metadata) -> None:
        super().plan(metadata)
        self._plan.slot_mapping = self._plan.slot_mapping.clamp(min=0)


def test_staged_arrays_arrive_whole_and_stay_valid_through_the_next_step():
    staging = StepStaging(CPU, capacity=8, stage=True)  # the CUDA path, plain copies
    staging.begin()
    a = staging.put(np.arange(5))
    b = staging.put(np.array([[1, 2], [3, 4]], dtype=np.int32), torch.int32)
    c = staging.put(np.arange(100, 120))  # past the capacity: a new buffer
    d = staging.put([7, 8])
    assert a.tolist() == list(range(5)) and a.dtype == torch.int64
    assert b.tolist() == [[1, 2], [3, 4]] and b.dtype == torch.int32
    assert c.tolist() == list(range(100, 120)) and d.tolist() == [7, 8]
    assert a.data_ptr() != c.data_ptr()
    staging.begin()  # the next step: the other set of buffers (double-buffered)
    e = staging.put(np.array([9]))
    assert e.tolist() == [9] and staging.put(np.zeros(0, dtype=np.int64)).numel() == 0
    assert a.tolist() == list(range(5)) and d.tolist() == [7, 8]  # the last step's: intact
    staging.begin()  # the step after: the first set again, from the front
    f = staging.put(np.array([11, 12]))
    assert f.data_ptr() == c.data_ptr() and e.tolist() == [9]
    direct = StepStaging(CPU)  # the CPU's default: no copy
    assert direct.put(np.array([[5, 6]]), torch.int32).tolist() == [[5, 6]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-argmax"))


def _loaded(cls, tiny, head_dir):
    config = LMKitConfig.model_validate({"model": {"model": str(tiny)},
                                         "speculative": {"model": str(head_dir)}})
    proposer = cls(config)
    hf = load_hf_config(tiny)
    proposer.check_target(hf)
    ctx = ModelBuildContext(dtype=torch.float32, device=CPU, block_size=BLOCK,
                            attention_cls=ScratchSlotTorchAttention)
    target = LlamaForCausalLM(hf, ctx)
    target.load_weights(iterate_weights(tiny))
    proposer.load(DraftHeadContext(target, hf, ctx))
    return proposer


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3-unmapped"])
def test_draft_argmax_equals_the_argmax_of_the_logits(tiny, tmp_path, kind):
    if kind == "eagle":
        proposer = _loaded(EagleProposer, tiny, make_tiny_eagle_head(tmp_path / "h", tiny))
    else:
        vocab = None if kind == "eagle3-unmapped" else 200
        proposer = _loaded(Eagle3Proposer, tiny, make_tiny_eagle3_head(
            tmp_path / "h", tiny, draft_vocab_size=vocab))
    assert proposer.target_feature_size == 64 * max(1, len(proposer.target_layers))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(33, proposer.hidden_size, generator=g)
    hidden[0] = 0  # all logits equal: the lowest target id wins either way
    with torch.inference_mode():
        want = proposer.compute_logits(hidden).argmax(dim=-1)
        assert torch.equal(proposer.draft_argmax(hidden), want)


def test_eagle3_draft_argmax_with_a_map_out_of_order(tiny, tmp_path):
    """A ``d2t`` whose target ids are not ascending in draft-id order would break ties
    differently: such a head takes the full logits' argmax."""
    proposer = _loaded(Eagle3Proposer, tiny, make_tiny_eagle3_head(tmp_path / "h", tiny))
    head = proposer.head
    assert head.ids_ascending
    ids = torch.arange(len(head.d2t)) + head.d2t
    head.d2t.copy_(ids.flip(0) - torch.arange(len(ids)))
    head.map_vocabulary()
    assert not head.ids_ascending
    hidden = torch.randn(9, proposer.hidden_size, generator=torch.Generator().manual_seed(1))
    hidden[0] = 0
    with torch.inference_mode():
        assert torch.equal(proposer.draft_argmax(hidden),
                           proposer.compute_logits(hidden).argmax(dim=-1))


def _verification_step(contexts):
    """A batch whose requests computed ``contexts`` tokens and now run ``1 + K`` (the
    last token and K drafts); blocks 1.. spread over the pool, room for K more drafts."""
    batch = InputBatch(8, 128, BLOCK, 256)
    rng = np.random.default_rng(0)
    for i, ctx in enumerate(contexts):
        state = CachedRequestState(str(i), rng.integers(0, 256, ctx + 2 + K).tolist(), [],
                                   None, None, None, ctx)
        batch.add_request(state, [1 + 12 * i + j for j in range(-(-(ctx + 2 * K + 1) // BLOCK))])
    n = len(contexts)
    return batch, batch.prepare(np.arange(n), np.full(n, 1 + K, dtype=np.int64), 0)


@pytest.mark.parametrize("proposer_cls", [EagleProposer, Eagle3Proposer])
def test_flattened_catch_up_matches_the_eager_one(tiny, tmp_path, proposer_cls):
    make = make_tiny_eagle_head if proposer_cls is EagleProposer else make_tiny_eagle3_head
    proposer = _loaded(proposer_cls, tiny, make(tmp_path / "h", tiny))
    batch, step = _verification_step([0, 9, 30, 14, 5])
    num_kept = np.array([4, 1, 3, 4, 2])  # accepted drafts + 1, crossing block boundaries
    drafting = np.array([True, True, False, True, True])
    g = torch.Generator().manual_seed(2)
    features = torch.randn(step.num_tokens, proposer.target_feature_size, generator=g)
    results = []
    for flattened in (False, True):
        runner = DraftRunner(proposer, K, batch, 128, CPU)
        runner.allocate(64)
        for cache in runner.kv_caches:
            cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(3)))
        if flattened:
            runner.catch_up_graphs = DraftPassGraphs(
                proposer, runner.kv_caches, proposer.target_feature_size, torch.float32, CPU,
                8 * (1 + K), 128, BLOCK, use_graphs=False)
        with torch.inference_mode():
            drafts = runner.propose(features, step, num_kept, drafting)
        results.append((drafts, runner))
    (eager, eager_runner), (flat, flat_runner) = results
    assert flat_runner.catch_up_graphs.num_passes == 1 and flat_runner.num_flattened_catch_ups
    assert eager_runner.num_eager_catch_ups == 1
    assert flat == eager and sorted(flat) == [0, 1, 3, 4]
    for a, b in zip(eager_runner.kv_caches, flat_runner.kv_caches, strict=True):
        torch.testing.assert_close(a[:, 1:], b[:, 1:])  # block 0: padding rows' writes
