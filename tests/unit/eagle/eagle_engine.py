"""Helpers of the EAGLE tests in this folder (their fixtures are in ``conftest.py``):
the shared settings and prompts, an in-process engine run that records every draft, and
the graph runners' padded replays on the CPU."""

from __future__ import annotations

from lmkit import SamplingParams
from lmkit.api import LMKitConfig
from lmkit.api.request import Request
from lmkit.plugin_host.manager import PluginHost
from lmkit.spec_decode.manager import ProposerManager

COMMON = dict(device="cpu", dtype="float32", max_model_len=256, block_size=4)
PROMPTS = ["abcabcabcabc", "the cat sat on the mat; the cat", "x", "0123401234",
           "abcabcabcabc"]  # the last one hits the prefix cache of the first
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
#: (max_num_seqs, num_blocks, max_num_batched_tokens) the lossless tests run under
BATCHINGS = [
    (1, 96, 512),  # one request at a time
    (8, 96, 512),  # the whole batch, prefix-cache hits
    (8, 20, 16),  # a small KV pool (preemptions) and chunked prefill
]
#: run_engine's keyword settings that go to the config's ``speculative`` section
SPECULATIVE_KEYS = ("disable_by_batch_size", "catch_up_when_off", "adaptive",
                    "device_step_max_requests", "tree")


def tokens(outs):
    """Each output's first completion's token ids."""
    return [o.outputs[0].token_ids for o in outs]


def regex_case(tiny):
    """The constrained tests' case: its prompts, a greedy request held to a regular
    expression, and the outputs ``tiny`` decodes for them without speculation."""
    from lmkit import LLM

    params = SamplingParams(temperature=0.0, max_tokens=24,
                            structured_outputs={"regex": "[ab]{4,20}c"})
    prompts = ["abab", "the cat", "x"]
    with LLM(str(tiny), structured_output="auto", num_blocks=96, **COMMON) as llm:
        return prompts, params, tokens(llm.generate(prompts, params))


def run_engine(tiny, head, monkeypatch, prompts, proposer="eagle", params=None,
               offload=None, parallel=None, **settings):
    """Run ``prompts`` greedily in an in-process engine; return what the head drafted
    for each request at each length: ``{(prompt index, tokens so far): drafts}``, and
    the engine's stats. ``offload``: the config's ``offload`` section (none: off);
    ``parallel``: its ``parallel`` section (tensor parallel: the ranks in worker
    processes, the drafts recorded here, in the engine); ``k`` (in ``settings``): draft
    tokens per step (3); :data:`SPECULATIVE_KEYS` in ``settings`` go to the
    ``speculative`` section (else its defaults), the rest to ``scheduler``."""
    from lmkit.engine.core import EngineCore

    seen: dict[tuple[int, int], list[int]] = {}
    take = ProposerManager.take_runner_drafts

    def record(self, requests, drafts):
        for r in requests:
            if r.request_id in drafts:
                seen[(int(r.request_id), tuple(r.all_token_ids))] = list(drafts[r.request_id])
        return take(self, requests, drafts)

    monkeypatch.setattr(ProposerManager, "take_runner_drafts", record)
    config = LMKitConfig.model_validate({
        "model": {"model": str(tiny), "dtype": "float32", "max_model_len": 64},
        "attention": {"backend": "torch"}, "executor": {"device": "cpu"},
        "cache": {"block_size": 4, "num_blocks": settings.pop("num_blocks", 96)},
        "speculative": {"backend": proposer, "model": str(head), "num_speculative_tokens": settings.pop("k", 3),
                        **{key: settings.pop(key) for key in SPECULATIVE_KEYS if key in settings}},
        "scheduler": settings, **({"offload": offload} if offload else {}),
        **({"parallel": parallel} if parallel else {})})
    core = EngineCore(config, PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}),
                      progress=False)
    try:
        tok = core.facts
        for i, prompt in enumerate(prompts):
            core.add_request(Request(str(i), list(prompt.encode()),
                                     GREEDY if params is None else params[i],
                                     eos_token_id=tok.eos_token_id))
        while core.has_unfinished_requests():
            core.step()
        stats = {**core.stats(), "executor": core.stack.get("executor").name}
    finally:
        core.shutdown()
        # unwrap, so that a later run in the same test records into its own dict only
        monkeypatch.setattr(ProposerManager, "take_runner_drafts", take)
    return seen, stats



def padded_replays(monkeypatch, flat_tokens: int = 0):
    """Make the runner verify, and the head catch up and draft, through the graph
    runners' padded, fixed-buffer forwards on the CPU (``use_graphs=False``: the graph
    path without capture), the padding rows' cache writes (slot -1) sent to the null
    block 0; steps of at most ``flat_tokens`` tokens replay flattened
    (:mod:`lmkit.worker.flat_steps`). Returns the target's graph runners and the draft
    runners (their ``graphs`` and ``catch_up_graphs`` count the passes replayed)."""
    import lmkit.worker.model_runner as model_runner
    from lmkit.worker.cuda_graphs import CudaGraphRunner
    from lmkit.worker.draft_runner import DraftRunner
    from lmkit_plugins.attention.torch_ref import TorchAttention

    made: list[CudaGraphRunner] = []
    drafters: list[DraftRunner] = []
    plan, capture_graphs = TorchAttention.plan, DraftRunner.capture_graphs

    def plan_scratch_padding(self, metadata):
        plan(self, metadata)
        self._plan.slot_mapping = self._plan.slot_mapping.clamp(min=0)

    def record_drafter(self, *args):
        capture_graphs(self, *args)
        drafters.append(self)

    def capture(config, stack, model, kv_caches, device, max_model_len, aux_layers=()):
        made.append(CudaGraphRunner(
            model, kv_caches, device, config.scheduler.max_num_seqs, max_model_len,
            config.cache.block_size, use_graphs=False,
            max_query_len=1 + config.speculative.num_speculative_tokens, aux_layers=aux_layers,
            flat_tokens=flat_tokens, tree=bool(config.speculative.tree)))
        return made[-1]

    monkeypatch.setattr(TorchAttention, "plan", plan_scratch_padding)
    monkeypatch.setattr(DraftRunner, "capture_graphs", record_drafter)
    monkeypatch.setattr(model_runner, "maybe_capture", capture)
    return made, drafters


def lookaheads_on_the_cpu(monkeypatch, cls) -> list:
    """Let the runner build its lookaheads on the CPU (the decode lookahead's slot
    reserved as on CUDA); returns the instances of ``cls`` (``DecodeLookahead`` or
    ``SpecLookahead``) built."""
    import lmkit.worker.gpu_lookahead as gpu_lookahead
    import lmkit.worker.model_runner as model_runner
    import lmkit.worker.spec_lookahead as spec_lookahead

    made: list = []
    init = cls.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    for module in (gpu_lookahead, model_runner, spec_lookahead):
        monkeypatch.setattr(module, "decode_lookahead_slots", lambda config, stack: 1)
    monkeypatch.setattr(cls, "__init__", record)
    return made


def spec_slots_reserved(monkeypatch) -> list[int]:
    """Record the runner's ``spec_lookahead_slots`` answers (one per runner built);
    returns the list they are appended to."""
    import lmkit.worker.model_runner as model_runner
    import lmkit.worker.spec_lookahead as spec_lookahead

    slots: list[int] = []

    def record(config, stack):
        slots.append(spec_lookahead.spec_lookahead_slots(config, stack))
        return slots[-1]

    monkeypatch.setattr(model_runner, "spec_lookahead_slots", record)
    return slots
