"""An FP8 (e4m3) KV cache on CUDA: the compiled cache write stores exactly what torch's
float8 conversion gives (scaled, saturated, rounded to nearest even), the compiled
decode (one- and two-launch merges) and prefill kernels read it as its values times the
scales at Llama-3.1-8B's head counts, and the engine with ``--kv-cache-dtype fp8``
(triton, CUDA graphs on; scales measured at load and 1.0) follows the bf16 cache's
greedy tokens on the 2-layer Llama-8B-shaped copy circuit, whose argmax a wrong K/V read
would flip; a backend that lacks the feature is refused by name."""

from __future__ import annotations

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from copy_circuit_model import llama_config, write_copy_circuit_model  # noqa: E402
from lmkit import SamplingParams  # noqa: E402
from lmkit.errors import NoBackendError  # noqa: E402
from lmkit.frontend.llm import LLM  # noqa: E402
from lmkit_kernels.cache_write import reshape_and_cache  # noqa: E402
from lmkit_kernels.fp8 import E4M3_MAX as FP8_MAX  # noqa: E402
from lmkit_kernels.paged_attention import paged_attention, split_counters  # noqa: E402
from lmkit_kernels.random_batch import make_paged_batch  # noqa: E402
from lmkit_kernels.reference import paged_attention_ref  # noqa: E402

FP8 = torch.float8_e4m3fn
CUDA = torch.device("cuda")


def _quantize(x, scale):
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_compiled_cache_write_matches_torch_bit_for_bit(scale):
    kv = torch.zeros(2, 64, 16, 8, 128, dtype=FP8, device=CUDA)
    qkv = (torch.randn(300, 48, 128, device=CUDA) * 60).to(torch.bfloat16)
    qkv[0, 32, :2] = torch.tensor([3e4, -3e4])  # saturated, not inf or NaN
    key, value = qkv[:, 32:40], qkv[:, 40:]
    slots = torch.randperm(64 * 16, device=CUDA)[:300]
    reshape_and_cache(key, value, kv, slots, scale, scale)
    blocks, offsets = slots // 16, slots % 16
    assert torch.equal(kv[0, blocks, offsets].view(torch.uint8),
                       _quantize(key, scale).view(torch.uint8))
    assert torch.equal(kv[1, blocks, offsets].view(torch.uint8),
                       _quantize(value, scale).view(torch.uint8))
    assert torch.isfinite(kv.float()).all()


@pytest.mark.parametrize("merge_in_kernel", [True, False])
def test_compiled_decode_and_prefill_read_scaled_fp8(merge_in_kernel):
    k_scale, v_scale = 0.5, 1.3
    for reqs in ([(c, 1) for c in (7, 300, 2000, 4095)] * 8, [(0, 300), (500, 64), (900, 1)]):
        batch = make_paged_batch(reqs, num_heads=32, num_kv_heads=8, head_size=128,
                                 block_size=16, dtype=torch.bfloat16, device="cuda", seed=1)
        cache8 = torch.stack((_quantize(batch.kv_cache[0], k_scale),
                              _quantize(batch.kv_cache[1], v_scale)))
        decode = batch.max_query_len == 1
        out = paged_attention(
            batch.q, cache8, batch.query_start_loc, batch.seq_lens, batch.block_tables,
            max_query_len=batch.max_query_len, k_scale=k_scale, v_scale=v_scale,
            **({"num_splits": 4, "split_counters": split_counters(len(reqs), 8, CUDA)
                if merge_in_kernel else None} if decode else {}))
        deq = torch.stack((cache8[0].float() * k_scale, cache8[1].float() * v_scale))
        ref = paged_attention_ref(batch.q, deq.to(torch.bfloat16), batch.query_start_loc,
                                  batch.seq_lens, batch.block_tables, 128 ** -0.5)
        n = batch.num_tokens
        torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=3e-2, rtol=3e-2)


@pytest.fixture(scope="module")
def llama8b_shape(tmp_path_factory):
    return write_copy_circuit_model(tmp_path_factory.mktemp("llama8b-fp8kv"),
                                    llama_config(2), device="cuda")


def _greedy(model_dir, **engine):
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 1000 + 10 for j in range(n)]}
               for i, n in enumerate((5, 90, 700, 1500, 33, 260))]
    with LLM(str(model_dir), attention="triton", dtype="bfloat16", max_num_seqs=8,
             max_model_len=2048, num_blocks=1024, device="cuda", **engine) as llm:
        runner = llm.engine.executor.runner
        assert runner.cuda_graphs is not None
        caches = runner.kv_caches
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        return ([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)],
                caches[0].dtype)


def _agreement(a, b):
    pairs = [(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def test_engine_fp8_cache_follows_bf16_on_the_copy_circuit(llama8b_shape):
    want, dtype = _greedy(llama8b_shape)
    assert dtype == torch.bfloat16
    # scales 1.0, and measured at load (e4m3's 3 mantissa bits may flip a copy far back
    # in a long prompt; a wrong slot, block or scale flips nearly every one)
    for scales in ("auto", "calibrate"):
        got, dtype = _greedy(llama8b_shape, kv_cache_dtype="fp8",
                             **{"cache.kv_cache_scales": scales})
        assert dtype == FP8
        assert _agreement(got, want) >= 0.9, scales
    # chunked prefill over the FP8 cache (64-token steps, piecewise graphs)
    chunked = _greedy(llama8b_shape, kv_cache_dtype="fp8", max_num_batched_tokens=64)[0]
    assert _agreement(chunked, want) >= 0.9


def test_a_backend_without_the_feature_is_refused(llama8b_shape):
    with pytest.raises(NoBackendError, match="does not support fp8_kv_cache"):
        LLM(str(llama8b_shape), attention="mla_triton", kv_cache_dtype="fp8", device="cuda")
