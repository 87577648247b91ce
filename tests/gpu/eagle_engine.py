"""An in-process CUDA engine with EAGLE drafting and CUDA graphs, recording every draft
(shared by the EAGLE GPU tests)."""

from __future__ import annotations

from lmkit import SamplingParams
from lmkit.api import LMKitConfig
from lmkit.api.request import Request
from lmkit.plugin_host.manager import PluginHost
from lmkit.spec_decode.manager import ProposerManager

PROMPTS = ["abcabcabcabc", "the cat sat on the mat; the cat", "x", "0123401234",
           "abcabcabcabc"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def instances(monkeypatch, cls) -> list:
    """Every ``cls`` built from now on (its ``__init__`` patched to record them)."""
    made: list = []
    init = cls.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(cls, "__init__", record)
    return made


def run_engine(tiny, head, proposer, monkeypatch, speculative=True, params=None,
               settings=None):
    """Outputs and every draft (``{(request, tokens so far): drafts}``) of an in-process
    CUDA engine with graphs on over :data:`PROMPTS` (``params[i]`` for prompt ``i``;
    default all :data:`GREEDY`), and its draft runner (``None`` without one);
    ``settings``: more of the ``speculative`` section."""
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
    spec = ({"backend": proposer, "model": str(head), "num_speculative_tokens": 3,
             **(settings or {})} if speculative else {})
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
            core.add_request(Request(str(i), list(prompt.encode()),
                                     GREEDY if params is None else params[i],
                                     eos_token_id=core.facts.eos_token_id))
        while core.has_unfinished_requests():
            for out in core.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    finally:
        core.shutdown()
    return outputs, seen, (drafters[0] if drafters else None)
