"""EAGLE heads on CUDA with captured graphs: the draft passes replay real CUDA graphs
that take their greedy drafts inside the replay and feed them to the next pass on the
device (``RunnerProposer.supports_graph_drafts``). On the tiny random Llama with random
``eagle`` / ``eagle3`` heads (float32, triton attention): greedy outputs equal plain
decoding, and the drafts equal those of the same graphs with the argmax run eagerly
after each replay (the same kernels, captured or not). The ``k - 1 = 2`` greedy draft
passes replay as one chained graph (triton keeps its captured decode plan valid as the
positions move); with ``LMKIT_DRAFT_CHAIN=0`` they replay one graph per pass, with the
same drafts."""

from __future__ import annotations

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from eagle_engine import run_engine as _run  # noqa: E402
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_drafts_taken_inside_captured_graphs(tmp_path, monkeypatch, proposer):
    from lmkit_plugins.spec.eagle import EagleProposer
    from lmkit_plugins.spec.eagle3 import Eagle3Proposer

    # head size 64: the smallest the triton backend serves
    tiny = make_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2)
    head = (make_tiny_eagle_head(tmp_path / "head", tiny, layer_std=0.3) if proposer == "eagle"
            else make_tiny_eagle3_head(tmp_path / "head", tiny))
    plain, _, _ = _run(tiny, head, proposer, monkeypatch, speculative=False)
    in_graph, drafts, drafter = _run(tiny, head, proposer, monkeypatch)
    assert in_graph == plain
    assert drafter.graphs is not None and drafter.graphs.runner.use_graphs
    assert drafter.graphs.drafts_in_graph and drafter.graphs.num_passes > 10
    assert drafter.graphs.chain == 2
    monkeypatch.setenv("LMKIT_DRAFT_CHAIN", "0")
    unchained, unchained_drafts, drafter = _run(tiny, head, proposer, monkeypatch)
    assert drafter.graphs.chain == 1 and unchained == plain and unchained_drafts == drafts
    monkeypatch.delenv("LMKIT_DRAFT_CHAIN")
    cls = EagleProposer if proposer == "eagle" else Eagle3Proposer
    monkeypatch.setattr(cls, "supports_graph_drafts", False)
    eager, eager_drafts, drafter = _run(tiny, head, proposer, monkeypatch)
    assert not drafter.graphs.drafts_in_graph and eager == plain
    assert len(drafts) > 20 and drafts == eager_drafts
