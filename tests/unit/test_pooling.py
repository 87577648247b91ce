"""Pooling pieces on the CPU: parameters, the built-in poolers across chunks, the
finishing step (truncate, normalize), the scheduler finishing a pooling request and
freeing its KV, bidirectional attention, and backend selection for encoders."""

from __future__ import annotations

import pytest
import torch
from lmkit.api import PoolingParams, Request, SamplingParams
from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.config import LMKitConfig
from lmkit.errors import InvalidRequestError, NoBackendError
from lmkit.loading.model_facts import load_model_facts
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import resolve_stack
from lmkit.scheduler.paged import PagedScheduler
from lmkit.worker.pooling import finalize
from lmkit_plugins.poolers.builtin import AllPooler, CLSPooler, LastPooler, MeanPooler
from test_torch_attention import DTYPE, make_metadata
from transformers import BertConfig


def test_pooling_params_validate_at_construction():
    with pytest.raises(InvalidRequestError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(InvalidRequestError, match="pooling_type must be a pooler name"):
        PoolingParams(pooling_type="")


@pytest.mark.parametrize("pooler_cls", [LastPooler, MeanPooler, CLSPooler, AllPooler])
def test_chunks_pool_exactly_as_one_step(pooler_cls):
    hidden = torch.randn(23, 8)
    pooler = pooler_cls()
    whole = pooler.pool(hidden)
    state = pooler.start()
    for start in range(0, 23, 5):
        state = pooler.accumulate(state, hidden[start:start + 5], start)
    assert torch.allclose(pooler.finish(state, 23), whole, atol=1e-6)
    expected = {LastPooler: hidden[-1], MeanPooler: hidden.mean(0), CLSPooler: hidden[0],
                AllPooler: hidden}[pooler_cls]
    assert torch.allclose(whole, expected, atol=1e-6)


def test_finalize_truncates_then_normalizes():
    vec = torch.tensor([3.0, 4.0, 12.0])
    assert finalize(vec, PoolingParams(dimensions=2)).tolist() == pytest.approx([0.6, 0.8])
    assert finalize(vec, PoolingParams(normalize=False)).tolist() == [3.0, 4.0, 12.0]
    per_token = finalize(torch.tensor([[3.0, 4.0], [0.0, 2.0]]), PoolingParams())
    assert torch.allclose(per_token, torch.tensor([[0.6, 0.8], [0.0, 1.0]]))


def _scheduler(**overrides) -> PagedScheduler:
    config = LMKitConfig.model_validate({
        "model": {"max_model_len": 128}, "cache": {"block_size": 4},
        "scheduler": {"max_num_batched_tokens": 8, **overrides}})
    return PagedScheduler(config, num_blocks=64)


def _pooling_request(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1), max_tokens=1,
                   pooling_params=PoolingParams())


def test_scheduler_chunks_a_pooling_prompt_then_finishes_it_and_frees_its_kv():
    sched = _scheduler()
    sched.add_request(_pooling_request("p", 19))
    sched.add_request(Request("g", [5, 6, 7], SamplingParams(max_tokens=4), max_tokens=4))
    chunks = []
    for _ in range(3):  # 8 + 8 + 3 prompt tokens; nothing pooled before the last chunk
        so = sched.schedule()
        chunks.append(so.num_scheduled_tokens.get("p", 0))
        sampled = [[9] if rid == "g" and sched.requests["g"].num_computed_tokens >= 3 else []
                   for rid in so.num_scheduled_tokens]
        out = ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens),
                                sampled_token_ids=sampled)
        if sched.requests["p"].num_computed_tokens >= 19:
            out.pooled = {"p": [1.0, 0.0]}
        outs = sched.update_from_output(so, out)
    assert chunks[0] + chunks[1] + chunks[2] == 19
    assert [o.pooled for o in outs if o.request_id == "p"] == [[1.0, 0.0]]
    assert [o.finish_reason for o in outs if o.request_id == "p"] == ["stop"]
    assert "p" not in sched.requests and sched.requests["g"].num_output_tokens >= 1
    sched.finish_requests("g", sched.requests["g"].status.FINISHED_ABORTED)
    assert sched.kv_cache_manager.usage == 0.0


def test_pooling_requests_skip_the_prefix_cache():
    sched = _scheduler(max_num_batched_tokens=64)
    first = Request("a", list(range(1, 17)), SamplingParams(max_tokens=2), max_tokens=2)
    sched.add_request(first)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[3]]))
    sched.add_request(_pooling_request("p", 16))  # same prompt: its blocks are cached
    so = sched.schedule()
    assert so.num_scheduled_tokens["p"] == 16  # every position computed for the pooler


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("max_groups", [1, 8])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
@pytest.mark.parametrize("lens", [[5, 3, 1], [4, 4], [7], [9, 1, 4, 4, 7, 2, 3, 8, 5, 6, 2],
                                  [16, 16], [17, 3, 16], [1, 3, 2, 4]])
def test_non_causal_attention_sees_every_key_of_its_request(num_kv_heads, lens, max_groups,
                                                            fused):
    from lmkit_plugins.attention.encoder_groups import fused_qkv_rows
    from lmkit_plugins.attention.torch_ref import TorchAttention

    block, heads = 4, 4
    attn = TorchAttention(num_heads=heads, num_kv_heads=num_kv_heads, head_size=8,
                          scale=8 ** -0.5, dtype=DTYPE, device=torch.device("cpu"),
                          block_size=block, causal=False)
    attn.max_length_groups = max_groups  # one padded call, or requests of similar length
    tables = [[1 + 5 * i + j for j in range(5)] for i in range(len(lens))]
    attn.plan(make_metadata([(0, n) for n in lens], block, tables))
    total = sum(lens)
    if fused:  # column slices of one QKV projection's rows (one gather moves all three)
        qkv = torch.randn(total, (heads + 2 * num_kv_heads) * 8 + 3, dtype=DTYPE)
        q = qkv[:, :heads * 8].view(total, heads, 8)
        k, v = (qkv[:, (heads + i * num_kv_heads) * 8:(heads + (i + 1) * num_kv_heads) * 8]
                .view(total, num_kv_heads, 8) for i in range(2))
        assert fused_qkv_rows(q, k, v) is not None
    else:
        q = torch.randn(total, heads, 8, dtype=DTYPE)
        k, v = (torch.randn(total, num_kv_heads, 8, dtype=DTYPE) for _ in range(2))
        assert fused_qkv_rows(q, k, v) is None
    cache = torch.zeros(attn.kv_cache_shape(5 * len(lens) + 1), dtype=DTYPE)
    out = attn.run(0, q, k, v, cache)
    assert out.shape == q.shape
    group = heads // num_kv_heads
    start = 0
    for n in lens:
        s = slice(start, start + n)
        kk = k[s].repeat_interleave(group, dim=1)  # query head h reads KV head h // group
        vv = v[s].repeat_interleave(group, dim=1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[s].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), scale=8 ** -0.5)
        assert torch.allclose(out[s], ref.transpose(0, 1), atol=1e-6)
        start += n


@pytest.mark.parametrize("lens", [[5, 30, 17, 40, 6, 33, 12, 16], [7], [16, 16], [15, 15]])
def test_cpu_bfloat16_encoder_groups_are_padded_to_multiples_of_16(lens):
    # torch's CPU flash attention is 2-4x faster at multiples of 16 tokens; the padding
    # keys are masked, so every request still attends to exactly its own keys
    from lmkit_plugins.attention.torch_ref import TorchAttention

    bf16, heads = torch.bfloat16, 2
    attn = TorchAttention(num_heads=heads, num_kv_heads=heads, head_size=8, scale=8 ** -0.5,
                          dtype=bf16, device=torch.device("cpu"), block_size=4, causal=False)
    tables = [[10 * i + j for j in range(10)] for i in range(len(lens))]
    attn.plan(make_metadata([(0, n) for n in lens], 4, tables))
    groups = attn._bidirectional.groups
    assert all(g.max_query_len % 16 == 0 for g in groups)
    assert sum(g.num_reqs for g in groups) == len(lens)
    q, k, v = (torch.randn(sum(lens), heads, 8).to(bf16) for _ in range(3))
    out = attn.run(0, q, k, v, torch.zeros(attn.kv_cache_shape(1), dtype=bf16))
    start = 0
    for n in lens:
        s = slice(start, start + n)
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(x[s].float().transpose(0, 1) for x in (q, k, v)), scale=8 ** -0.5)
        torch.testing.assert_close(out[s].float(), ref.transpose(0, 1), atol=2e-2, rtol=2e-2)
        start += n


def test_length_groups_cover_every_request_once_and_cut_padding():
    import numpy as np
    from lmkit_plugins.attention.encoder_groups import length_groups

    lens = np.array([40, 6, 33, 12, 8, 25, 7, 39, 15, 30, 9, 11, 36, 20, 6, 28] * 4)
    groups = length_groups(lens)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(lens)))
    assert 1 < len(groups) <= 8
    padded = sum(len(g) * int(lens[g].max()) ** 2 for g in groups)
    assert padded < 0.6 * len(lens) * int(lens.max()) ** 2  # vs one call padded to 40
    assert len(length_groups(np.array([30, 31, 30, 29]))) == 1  # nothing to gain
    assert len(length_groups(lens, max_groups=1)) == 1


def _bert() -> BertConfig:
    return BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                      num_hidden_layers=1, vocab_size=100, architectures=["BertModel"])


def test_encoders_need_non_causal_attention_and_other_backends_are_refused(tmp_path):
    host = PluginHost.load()
    _bert().save_pretrained(tmp_path)
    facts = load_model_facts(tmp_path, host)
    assert not facts.generates and not facts.pooling.causal  # a PoolingModel
    assert facts.pooling.default_pooler == "cls"
    needs = facts.attention_needs
    assert "non_causal" in needs.features
    config = LMKitConfig.model_validate({"executor": {"device": "cpu"}})
    assert resolve_stack(config, host, needs).get("attention").name in ("cpu", "torch")
    named = LMKitConfig.model_validate({"executor": {"device": "cpu"},
                                        "attention": {"backend": "triton"}})
    with pytest.raises(NoBackendError, match="does not support non_causal"):
        resolve_stack(named, host, needs)
    for name in ("flashinfer", "flash_attn"):
        assert "does not support non_causal" in " ".join(
            host.registry.get("attention", name).spec.why_not(needs))


def test_model_facts_say_which_models_generate(tmp_path):
    """CausalLM generates; a PoolingModel (Llama family without its head) only pools."""
    from transformers import Qwen3Config

    host = PluginHost.load()
    for arch, generates in (("Qwen3ForCausalLM", True), ("Qwen3Model", False)):
        d = tmp_path / arch
        Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, num_hidden_layers=1, vocab_size=100,
                    architectures=[arch]).save_pretrained(d)
        facts = load_model_facts(d, host)
        assert facts.generates is generates, arch
        assert facts.pooling.causal and facts.pooling.default_pooler == "last"
        assert "non_causal" not in facts.attention_needs.features


def test_scoring_pairs_cosine_and_maxsim():
    from lmkit.frontend.scoring import pair_texts, score

    assert pair_texts("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pair_texts(["a", "b"], ["c", "d"]) == [("a", "c"), ("b", "d")]
    with pytest.raises(InvalidRequestError, match="same length"):
        pair_texts(["a", "b"], ["c", "d", "e"])
    assert score([1.0, 0.0], [2.0, 0.0]) == pytest.approx(1.0)
    assert score([1.0, 0.0], [0.0, 3.0]) == pytest.approx(0.0)
    q = [[1.0, 0.0], [0.0, 1.0]]
    assert score(q, [[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]) == pytest.approx(2.0)
    assert score(q, [[1.0, 1.0]]) == pytest.approx(2 * 2 ** -0.5)
    with pytest.raises(InvalidRequestError, match="cannot score"):
        score([1.0, 0.0], [1.0, 0.0, 0.0])


def test_dummy_steps_of_a_pooling_only_model_end_at_its_hidden_states(tmp_path):
    """Memory profiling and the warm-up step shapes (run on CUDA before serving) work
    for a model without a language-model head: its dummy steps stop at the hidden
    states instead of calling an LM head it does not have."""
    from lmkit.worker.dummy_steps import profile_run, warm_up_step_shapes
    from lmkit.worker.model_runner import ModelRunner
    from transformers import BertModel

    torch.manual_seed(0)
    BertModel(_bert()).save_pretrained(tmp_path)
    host = PluginHost.load()
    facts = load_model_facts(tmp_path, host, 256)
    config = LMKitConfig.model_validate({
        "model": {"model": str(tmp_path), "dtype": "float32", "max_model_len": 256},
        "executor": {"device": "cpu"}, "cache": {"block_size": 4},
        "scheduler": {"max_num_batched_tokens": 256, "enable_chunked_prefill": False}})
    runner = ModelRunner(config, resolve_stack(config, host, facts.attention_needs), host,
                         facts)
    runner.load_model()
    dummy = runner.dummy_step_model()
    hidden = torch.randn(3, 64)
    assert dummy.compute_logits(hidden) is hidden  # no LM head
    profile_run(dummy)
    warm_up_step_shapes(dummy)


def test_pool_step_finalizes_equal_vectors_together_as_one_by_one():
    # vectors of one size and parameters are stacked and normalized in one call; each
    # must equal its own finalize, and per-token outputs ("all") still come back whole
    from types import SimpleNamespace

    import numpy as np
    from lmkit.api.pooling import ModelPooling
    from lmkit.worker.pooling import PoolingRequests

    reqs = PoolingRequests(PluginHost.load(), ModelPooling(default_pooler="mean"))
    lens = [3, 5, 2, 4, 1]
    kinds = [PoolingParams(), PoolingParams(pooling_type="cls", dimensions=3),
             PoolingParams(normalize=False), PoolingParams(pooling_type="all"),
             PoolingParams(dimensions=3)]
    order = [f"r{i}" for i in range(len(lens))]
    for rid, n, params in zip(order, lens, kinds, strict=True):
        reqs.add(rid, params, n)
    hidden = torch.randn(sum(lens), 6)
    cu = np.cumsum(lens)
    step = SimpleNamespace(num_scheduled=np.array(lens), num_computed=np.zeros(len(lens)),
                           cu_num_tokens=cu)
    done = reqs.pool_step(hidden, order, step)
    assert list(done) == order and not reqs.states
    for i, (n, params) in enumerate(zip(lens, kinds, strict=True)):
        rows = hidden[cu[i] - n:cu[i]]
        pooler = {None: MeanPooler(), "cls": CLSPooler(), "all": AllPooler()}[
            params.pooling_type]
        expected = finalize(pooler.pool(rows), params)
        torch.testing.assert_close(torch.tensor(done[order[i]]), expected)
