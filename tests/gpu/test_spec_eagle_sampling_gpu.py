"""Sampled EAGLE drafts on CUDA with captured graphs: the sampling draft passes and
catch-up passes replay real CUDA graphs (the rows' parameters and pre-drawn uniforms in
fixed buffers, the drafts and their candidates taken inside the replay). For seeded
requests they draft exactly what the same passes draft with the sampling run eagerly
after each replay, the outputs are the same, and a greedy request beside them decodes as
without speculation."""

from __future__ import annotations

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from eagle_engine import GREEDY, PROMPTS, run_engine  # noqa: E402
from lmkit import SamplingParams  # noqa: E402
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402

PARAMS = [SamplingParams(temperature=1.2, top_k=60, top_p=0.95, seed=100 + i, max_tokens=32,
                         ignore_eos=True) for i in range(len(PROMPTS))]
PARAMS[2] = GREEDY


def _run(tiny, head, proposer, monkeypatch, speculative=True):
    return run_engine(tiny, head, proposer, monkeypatch, speculative, params=PARAMS)


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_sampled_drafts_in_captured_graphs_equal_eager_sampling(tmp_path, monkeypatch,
                                                                proposer):
    from lmkit_plugins.spec.eagle import EagleProposer
    from lmkit_plugins.spec.eagle3 import Eagle3Proposer

    tiny = make_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2)
    head = (make_tiny_eagle_head(tmp_path / "head", tiny, layer_std=0.3) if proposer == "eagle"
            else make_tiny_eagle3_head(tmp_path / "head", tiny))
    plain, _, _ = _run(tiny, head, proposer, monkeypatch, speculative=False)
    in_graph, drafts, drafter = _run(tiny, head, proposer, monkeypatch)
    graphs, catch_up = drafter.sampled_graphs, drafter.sampled_catch_up_graphs
    assert graphs is not None and graphs.runner.use_graphs and graphs.samples_in_graph
    assert graphs.num_passes > 10 and catch_up is not None and catch_up.num_passes > 10
    assert drafter.num_sampled_steps > 10
    assert in_graph["2"] == plain["2"]  # the greedy request
    cls = EagleProposer if proposer == "eagle" else Eagle3Proposer
    monkeypatch.setattr(cls, "supports_graph_drafts", False)  # sample after each replay
    eager, eager_drafts, drafter = _run(tiny, head, proposer, monkeypatch)
    assert drafter.sampled_graphs is None and drafter.graphs.runner.use_graphs
    assert len(drafts) > 20 and drafts == eager_drafts
    assert in_graph == eager
