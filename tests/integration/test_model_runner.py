"""ModelRunner and the uniproc executor: request lifecycle, sampling, errors.

Driven by hand-built SchedulerOutputs on a tiny random Llama saved as safetensors;
expected tokens come from HF transformers' ``generate``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lmkit.api.sampling_params import SamplingParams
from lmkit.api.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from lmkit.config.schema import LMKitConfig
from lmkit.errors import ModelLoadError
from lmkit.loading.model_facts import load_model_facts
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import resolve_stack
from lmkit.worker.dummy_steps import warm_up_step_shapes
from lmkit.worker.model_runner import ModelRunner
from lmkit_plugins.executors.uniproc import UniProcExecutor
from lmkit_plugins.models.rotary import rope_config_from_hf

VOCAB = 384
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, initializer_range=0.1,
                         tie_word_embeddings=True, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).eval()
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(directory)
    return model, directory


def lmkit_config(model_dir: Path, block_size: int = 4) -> LMKitConfig:
    return LMKitConfig.model_validate({
        "model": {"model": str(model_dir), "dtype": "float32"},
        "cache": {"block_size": block_size, "kv_cache_memory_gb": 0.001},
        "attention": {"backend": "torch"},
        "executor": {"device": "cpu"},
    })


def make_runner(model_dir: Path, block_size: int = 4) -> ModelRunner:
    config = lmkit_config(model_dir, block_size)
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    runner = ModelRunner(config, resolve_stack(config, host), host, load_model_facts(model_dir, host))
    runner.load_model()
    runner.initialize_kv_cache(256)
    return runner


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class MiniScheduler:
    """Just enough of a scheduler: explicit chunks, blocks on demand, drafts, preemption."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.free = list(range(runner.num_blocks))
        self.prompt: dict[str, list[int]] = {}
        self.output: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.eos: dict[str, int | None] = {}
        self.known: set[str] = set()  # requests the runner holds
        self.pending_finished: set[str] = set()
        self.pending_preempted: set[str] = set()

    def add(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY,
            eos: int | None = None) -> None:
        self.prompt[rid], self.output[rid], self.params[rid] = list(prompt), [], params
        self.eos[rid] = eos
        self.computed[rid], self.blocks[rid] = 0, []

    def finish(self, rid: str) -> None:
        self.known.discard(rid)
        self.free += self.blocks.pop(rid)
        self.pending_finished.add(rid)

    def preempt(self, rid: str) -> None:
        self.known.discard(rid)
        self.free += self.blocks[rid]
        self.blocks[rid], self.computed[rid] = [], 0
        self.pending_preempted.add(rid)

    def step(self, work: dict[str, int], drafts: dict[str, list[int]] | None = None):
        drafts = drafts or {}
        so = SchedulerOutput(finished_req_ids=self.pending_finished,
                             preempted_req_ids=self.pending_preempted)
        self.pending_finished, self.pending_preempted = set(), set()
        for rid, n in work.items():
            need = -(-(self.computed[rid] + n) // self.runner.block_size) - len(self.blocks[rid])
            new = [self.free.pop(0) for _ in range(max(need, 0))]
            self.blocks[rid] += new
            if rid in self.known:
                so.scheduled_cached_reqs.req_ids.append(rid)
                so.scheduled_cached_reqs.new_block_ids.append(new)
                so.scheduled_cached_reqs.num_computed_tokens.append(self.computed[rid])
            else:
                so.scheduled_new_reqs.append(NewRequestData(
                    rid, self.prompt[rid], list(self.output[rid]), self.params[rid],
                    list(self.blocks[rid]), self.computed[rid], eos_token_id=self.eos[rid]))
                self.known.add(rid)
            so.num_scheduled_tokens[rid] = n
        so.total_num_scheduled_tokens = sum(work.values())
        so.scheduled_spec_decode_tokens = {r: d for r, d in drafts.items() if d}
        out = self.runner.execute_model(so)
        for rid, sampled in zip(out.req_ids, out.sampled_token_ids, strict=True):
            rejected = len(drafts.get(rid, [])) + 1 - len(sampled) if sampled else 0
            self.computed[rid] += work[rid] - rejected
            self.output[rid] += sampled
        return out

    def prefill(self, rid: str) -> int:
        return len(self.prompt[rid]) + len(self.output[rid]) - self.computed[rid]


PROMPT_A = [5, 77, 300, 12, 9, 41, 8]
PROMPT_B = list(range(30, 52))
PROMPT_C = [200, 3]


def test_partial_prefill_samples_nothing_then_decodes_match_hf(tiny):
    model, directory = tiny
    sched = MiniScheduler(make_runner(directory))
    sched.add("b", PROMPT_B)
    out = sched.step({"b": 10})
    assert out.req_ids == ["b"] and out.sampled_token_ids == [[]]
    out = sched.step({"b": 12})
    assert len(out.sampled_token_ids[0]) == 1
    for _ in range(7):
        sched.step({"b": 1})
    assert sched.output["b"] == hf_greedy(model, PROMPT_B, 8)


def test_step_shape_warm_up_runs_mixed_steps_on_scratch_caches(tiny):
    """The JIT warm-up (run at start-up on CUDA) plans decodes mixed with a short and
    a long prefill over a cached prefix, and one request alone (the LM head's one-row
    kernel variant); the runner's KV cache and requests are left as they were."""
    model, directory = tiny
    runner = make_runner(directory)
    sched = MiniScheduler(runner)
    sched.add("a", PROMPT_A)
    sched.step({"a": sched.prefill("a")})
    kv_before = [c.clone() for c in runner.kv_caches]
    planned, plan = [], runner.model.attn.plan
    runner.model.attn.plan = lambda md: (planned.append(
        (md.num_decodes, md.query_start_loc_cpu.diff().tolist(), md.seq_lens_cpu.tolist())),
        plan(md))
    warm_up_step_shapes(runner.dummy_step_model())
    runner.model.attn.plan = plan
    long = 128 - 40  # the tiny model's max_model_len (128) leaves room for a 16-token prefix
    assert planned == [(3, [1, 1, 1, 5, long], [34, 18, 41, 5, long + 16]),
                       (1, [1, 7], [21, 7]), (3, [1, 1, 1], [10, 31, 65]), (1, [1], [13])]
    assert all(torch.equal(a, b) for a, b in zip(kv_before, runner.kv_caches, strict=True))
    for _ in range(5):
        sched.step({"a": 1})
    assert sched.output["a"] == hf_greedy(model, PROMPT_A, 6)


def test_finished_and_new_requests_reuse_rows(tiny):
    model, directory = tiny
    sched = MiniScheduler(make_runner(directory))
    for rid, prompt in (("a", PROMPT_A), ("b", PROMPT_B), ("c", PROMPT_C)):
        sched.add(rid, prompt)
    sched.step({r: sched.prefill(r) for r in "abc"})
    for _ in range(3):
        sched.step({r: 1 for r in "abc"})
    sched.finish("a")  # its row is filled by the last one
    sched.add("d", PROMPT_A[::-1])
    sched.step({"b": 1, "c": 1, "d": sched.prefill("d")})
    for _ in range(4):
        sched.step({r: 1 for r in "bcd"})
    assert sched.output["b"] == hf_greedy(model, PROMPT_B, 9)
    assert sched.output["c"] == hf_greedy(model, PROMPT_C, 9)
    assert sched.output["d"] == hf_greedy(model, PROMPT_A[::-1], 5)
    assert "a" not in sched.runner.requests


def test_preempted_request_resumes_with_its_output(tiny):
    model, directory = tiny
    sched = MiniScheduler(make_runner(directory))
    sched.add("a", PROMPT_A)
    sched.add("c", PROMPT_C)
    sched.step({"a": sched.prefill("a"), "c": sched.prefill("c")})
    for _ in range(3):
        sched.step({"a": 1, "c": 1})
    sched.preempt("a")
    sched.step({"c": 1})
    # recompute prompt + output so far in two chunks; the second samples the next token
    total = sched.prefill("a")
    out = sched.step({"a": total - 2, "c": 1})
    assert out.sampled_token_ids[out.req_ids.index("a")] == []
    sched.step({"a": 2})
    for _ in range(3):
        sched.step({"a": 1})
    assert sched.output["a"] == hf_greedy(model, PROMPT_A, 8)
    assert sched.output["c"] == hf_greedy(model, PROMPT_C, 6)


def test_prompt_logprobs_over_chunks_match_hf(tiny):
    model, directory = tiny
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, logprobs=3)
    sched = MiniScheduler(make_runner(directory))
    sched.add("b", PROMPT_B, params)
    out1 = sched.step({"b": 9})
    assert out1.prompt_logprobs == {}
    out2 = sched.step({"b": 13})
    lps = out2.prompt_logprobs["b"]
    assert len(lps) == len(PROMPT_B) and lps[0] is None
    with torch.inference_mode():
        ref = model(torch.tensor([PROMPT_B])).logits[0].float().log_softmax(-1)
    for pos in range(1, len(PROMPT_B)):
        entry = lps[pos]
        assert entry.token_id == PROMPT_B[pos]
        assert entry.logprob == pytest.approx(ref[pos - 1, PROMPT_B[pos]].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == ref[pos - 1].topk(2).indices.tolist()
    # sampled-token logprobs: one entry per token, for the token that was sampled
    (sampled,) = out2.sampled_token_ids[0]
    (entry,) = out2.logprobs[0]
    assert entry.token_id == sampled and entry.rank == 1 and len(entry.top) == 3
    out3 = sched.step({"b": 1})
    assert out3.prompt_logprobs == {}


def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    _, directory = tiny
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16)

    def run(with_others: bool) -> list[int]:
        sched = MiniScheduler(make_runner(directory))
        sched.add("x", PROMPT_A, seeded)
        work = {"x": len(PROMPT_A)}
        if with_others:
            sched.add("y", PROMPT_B, SamplingParams(temperature=0.7, top_k=5, max_tokens=16))
            sched.add("z", PROMPT_C, SamplingParams(temperature=1.3, seed=99, max_tokens=16))
            work.update(y=len(PROMPT_B), z=len(PROMPT_C))
        sched.step(work)
        for _ in range(9):
            sched.step(dict.fromkeys(work, 1))
        return sched.output["x"]

    alone, batched = run(False), run(True)
    assert alone == batched and len(alone) == 10
    assert len(set(alone)) > 1  # really sampled, not a constant


def test_draft_tokens_are_verified(tiny):
    model, directory = tiny
    expected = hf_greedy(model, PROMPT_A, 10)
    sched = MiniScheduler(make_runner(directory))
    sched.add("a", PROMPT_A)
    sched.step({"a": len(PROMPT_A)})
    assert sched.output["a"] == expected[:1]
    # three right drafts: all accepted plus the bonus token
    out = sched.step({"a": 4}, drafts={"a": expected[1:4]})
    assert out.sampled_token_ids == [expected[1:5]]
    assert out.num_draft_tokens == {"a": 3} and out.num_accepted_tokens == {"a": 3}
    # first draft right, second wrong: one accepted, then the target's own token
    wrong = (expected[6] + 1) % VOCAB
    out = sched.step({"a": 4}, drafts={"a": [expected[5], wrong, expected[7]]})
    assert out.sampled_token_ids == [expected[5:7]]
    assert out.num_accepted_tokens == {"a": 1}
    for _ in range(3):
        sched.step({"a": 1})
    assert sched.output["a"] == expected


def test_eos_is_banned_below_min_tokens(tiny):
    model, directory = tiny
    greedy = hf_greedy(model, PROMPT_C, 1)[0]
    sched = MiniScheduler(make_runner(directory))
    # the request's EOS is the greedy token: min_tokens forbids it at first
    sched.add("m", PROMPT_C, SamplingParams(temperature=0.0, min_tokens=2, max_tokens=8),
              eos=greedy)
    sched.add("n", PROMPT_C, GREEDY, eos=greedy)
    sched.step({"m": 2, "n": 2})
    assert sched.output["n"] == [greedy]
    assert sched.output["m"] != [greedy] and len(sched.output["m"]) == 1


def test_uniproc_executor_lifecycle(tiny):
    model, directory = tiny
    config = lmkit_config(directory)
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    executor = UniProcExecutor(config, resolve_stack(config, host), host=host)
    info = executor.start()
    facts = executor.facts
    assert (facts.architecture, facts.vocab_size, facts.max_model_len, facts.num_layers) == (
        "LlamaForCausalLM", VOCAB, 128, 2)
    # 2 layers x (K and V) x block_size 4 x 2 kv heads x head_size 16 x float32
    assert info.kv_bytes_per_block == 2 * 2 * 4 * 2 * 16 * 4
    assert info.available_kv_bytes == int(0.001 * 2**30)
    assert (info.device, info.dtype) == ("cpu", "float32")
    executor.initialize_kv_cache(64)
    assert executor.offload_lookup([b"x" * 32]) == (0, 0)  # no tier: typed defaults
    assert executor.offload_stats() == {}
    so = SchedulerOutput(scheduled_new_reqs=[NewRequestData("r", PROMPT_C, [], GREEDY,
                                                            [0], 0)],
                         num_scheduled_tokens={"r": 2}, total_num_scheduled_tokens=2)
    out = executor.execute(so)
    assert out.sampled_token_ids == [hf_greedy(model, PROMPT_C, 1)]
    empty = executor.execute(SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(), finished_req_ids={"r"}))
    assert empty.req_ids == []
    executor.shutdown()
    executor.shutdown()


def test_unknown_architecture_lists_supported(tiny, tmp_path):
    _, directory = tiny
    for f in directory.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FancyForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="FancyForCausalLM.*not supported.*Qwen3ForCausalLM"):
        make_runner(tmp_path)


def test_missing_and_unexpected_weights_are_named(tiny):
    _, directory = tiny
    runner = make_runner(directory)
    from safetensors.torch import load_file

    weights = load_file(str(next(directory.glob("*.safetensors"))))
    weights.pop("model.layers.1.mlp.up_proj.weight")
    weights["model.layers.7.self_attn.q_proj.weight"] = torch.zeros(1)
    with pytest.raises(ModelLoadError) as err:
        runner.model.load_weights(weights.items())
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert "model.layers.7.self_attn.q_proj.weight" in str(err.value)


def test_unsupported_rope_type_is_a_load_error():
    cfg = SimpleNamespace(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                           "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match="'dynamic'.*default, linear, llama3"):
        rope_config_from_hf(cfg, 64)
