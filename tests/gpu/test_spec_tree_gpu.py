"""Draft trees (``speculative.tree``) on CUDA with the triton backend: tree verification
and the head's level passes (all of a step's in one replay) replay CUDA graphs captured
with tree buffers; with ``LMKIT_TREE_GRAPHS=0`` both run eagerly beside the decode
graphs (which plain decode steps still replay), the tree steps through the prefill
kernel's tree variant. On the tiny random Llama with random ``eagle`` / ``eagle3`` heads
(float32): greedy outputs equal plain decoding, and whole trees were verified."""

from __future__ import annotations

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from eagle_engine import run_engine  # noqa: E402
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager-trees", "tree-graphs"])
@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_tree_outputs_equal_plain_decoding_on_cuda(tmp_path, monkeypatch, proposer, graphs):
    tiny = make_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2)
    head = (make_tiny_eagle_head(tmp_path / "head", tiny, layer_std=0.3) if proposer == "eagle"
            else make_tiny_eagle3_head(tmp_path / "head", tiny))
    plain, _, _ = run_engine(tiny, head, proposer, monkeypatch, speculative=False)
    if not graphs:  # (graphs: the default with a tree)
        monkeypatch.setenv("LMKIT_TREE_GRAPHS", "0")
    treed, drafts, drafter = run_engine(
        tiny, head, proposer, monkeypatch,
        settings={"tree": TREE, "num_speculative_tokens": len(TREE)})
    assert treed == plain
    level_graphs = drafter.graphs if drafter is not None else None
    assert (level_graphs is not None and level_graphs.runner.use_graphs
            and level_graphs.num_passes > 10) == graphs
    # whole trees (near max_tokens a request drafts a prefix of the tree)
    assert sum(len(d) == len(TREE) for d in drafts.values()) > 20
    assert all(0 < len(d) <= len(TREE) for d in drafts.values())
