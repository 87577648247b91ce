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

from lmkit import SamplingParams  # noqa: E402
from lmkit.api import LMKitConfig  # noqa: E402
from lmkit.api.request import Request  # noqa: E402
from lmkit.plugin_host.manager import PluginHost  # noqa: E402
from lmkit.spec_decode.manager import ProposerManager  # noqa: E402
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402

PROMPTS = ["abcabcabcabc", "the cat sat on the mat; the cat", "x", "0123401234",
           "abcabcabcabc"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PARAMS = [SamplingParams(temperature=1.2, top_k=60, top_p=0.95, seed=100 + i, max_tokens=32,
                         ignore_eos=True) for i in range(len(PROMPTS))]
PARAMS[2] = GREEDY


def _run(tiny, head, proposer, monkeypatch, speculative=True):
    """Outputs and every draft (``{(request, tokens so far): drafts}``) of an in-process
    CUDA engine with graphs on, and its draft runner."""
    from lmkit.engine.core import EngineCore
    from lmkit.worker.draft_runner import DraftRunner

    seen: dict = {}
    drafters: list = []
    take, capture = ProposerManager.take_runner_drafts, DraftRunner.capture_graphs

    def record(self, requests, drafts):
        for r in requests:
            if r.request_id in drafts:
                seen[(r.request_id, tuple(r.all_token_ids))] = list(drafts[r.request_id])
        return take(self, requests, drafts)

    def record_drafter(self, *args):
        capture(self, *args)
        drafters.append(self)

    monkeypatch.setattr(ProposerManager, "take_runner_drafts", record)
    monkeypatch.setattr(DraftRunner, "capture_graphs", record_drafter)
    spec = ({"backend": proposer, "model": str(head), "num_speculative_tokens": 3}
            if speculative else {})
    config = LMKitConfig.model_validate({
        "model": {"model": str(tiny), "dtype": "float32", "max_model_len": 128},
        "attention": {"backend": "triton"}, "executor": {"device": "cuda"},
        "cache": {"block_size": 16, "num_blocks": 64}, "speculative": spec,
        "scheduler": {"max_num_seqs": 8}})
    core = EngineCore(config, PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}),
                      progress=False)
    outputs: dict[str, list[int]] = {}
    try:
        for i, prompt in enumerate(PROMPTS):
            core.add_request(Request(str(i), list(prompt.encode()), PARAMS[i],
                                     eos_token_id=core.facts.eos_token_id))
        while core.has_unfinished_requests():
            for out in core.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    finally:
        core.shutdown()
    return outputs, seen, (drafters[0] if drafters else None)


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
