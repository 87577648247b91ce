"""The fused MoE kernel (:func:`lmkit_kernels.moe.fused_moe`) compiled on CUDA, and
Mixtral through the engine on CUDA.

* A Mixtral-8x7B layer's shape (hidden 4096, 8 experts of 14336, top-2) in bfloat16
  at decode (1, 7 tokens) and prefill (300 tokens) sizes against the torch reference.
* float32 multiplies in IEEE float32 (no TF32): near-exact against the reference.
* One launch captured in a CUDA graph and replayed over another routing.
* The large-tile configuration and the layer's route (fused / reference by token count).
* A tiny random Mixtral through ``LLM``: float32 greedy tokens equal transformers'
  (CPU), and bfloat16 with CUDA graphs equals bfloat16 eager.
"""

from __future__ import annotations

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from lmkit_kernels.moe import fused_moe  # noqa: E402
from lmkit_kernels.moe_ref import fused_moe_ref  # noqa: E402

CUDA = torch.device("cuda")


def _problem(tokens, hidden, inter, experts, top_k, dtype, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=CUDA) * scale).to(dtype)

    x = randn(tokens, hidden)
    w13 = randn(experts, 2 * inter, hidden, scale=hidden ** -0.5)
    w2 = randn(experts, hidden, inter, scale=inter ** -0.5)
    weights, ids = _routing(tokens, experts, top_k, seed + 1)
    return x, w13, w2, weights, ids


def _routing(tokens, experts, top_k, seed):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    weights, ids = torch.randn(tokens, experts, generator=g, device=CUDA).softmax(-1).topk(top_k)
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_mixtral_8x7b_shape_bf16(tokens):
    x, w13, w2, weights, ids = _problem(tokens, 4096, 14336, 8, 2, torch.bfloat16)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, 4096)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    rel = (out.float() - ref.float()).norm() / ref.float().norm()
    assert rel < 5e-3, rel


def test_float32_is_ieee():
    x, w13, w2, weights, ids = _problem(100, 1024, 2048, 8, 2, torch.float32, seed=3)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids),
                               fused_moe_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-4)


def _captured(warm_up, fn):
    """``(graph, out)``: ``fn()`` captured in a CUDA graph after ``warm_up()`` ran on a
    side stream (Triton compiles outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm_up()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_cuda_graph_replays_another_routing():
    x, w13, w2, weights, ids = _problem(8, 512, 1024, 8, 2, torch.bfloat16, seed=5)
    graph, out = _captured(lambda: fused_moe(x, w13, w2, weights, ids),
                           lambda: fused_moe(x, w13, w2, weights, ids))
    new_weights, new_ids = _routing(8, 8, 2, seed=11)
    assert not torch.equal(new_ids, ids)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out.float(), fused_moe_ref(x, w13, w2, weights, ids).float(),
                               atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tokens", [300, 1024])
def test_large_tiles_and_the_routed_layer(tokens):
    """The large-tile configuration bench/moe_kernel.py times, and MoEExperts' two
    routes (fused below 256 rows per expert, the reference from 1,024 Mixtral tokens),
    against the reference; inside a CUDA-graph capture the route is always fused."""
    from lmkit_plugins.models.fused_ops import MoEExperts

    x, w13, w2, weights, ids = _problem(tokens, 4096, 14336, 8, 2, torch.bfloat16, seed=7)
    ref = fused_moe_ref(x, w13, w2, weights, ids).float()
    large = fused_moe(x, w13, w2, weights, ids, block_m=128, block_n=128, block_k=64,
                      num_warps=8, num_stages=3)
    torch.testing.assert_close(large.float(), ref, atol=3e-2, rtol=3e-2)
    routed = MoEExperts(fused_moe, fused_moe_ref)
    assert routed.uses_fused(tokens, 2, 8) == (tokens < 1024)
    torch.testing.assert_close(routed(x, w13, w2, weights, ids).float(), ref, atol=3e-2,
                               rtol=3e-2)
    # the reference would sync inside the capture: the routed layer takes the fused kernel
    graph, out = _captured(lambda: fused_moe(x, w13, w2, weights, ids),
                           lambda: routed(x, w13, w2, weights, ids))
    graph.replay()
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    from lmkit.testing.tiny_model import make_byte_tokenizer
    from transformers import AutoModelForCausalLM, MixtralConfig

    path = tmp_path_factory.mktemp("tiny-mixtral")
    config = MixtralConfig(vocab_size=320, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=8, num_experts_per_tok=2, sliding_window=32,
                           max_position_embeddings=512, initializer_range=0.1,
                           eos_token_id=256, bos_token_id=None, pad_token_id=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    make_byte_tokenizer().save_pretrained(path)
    return path, model


PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 17, 40, 64))]


def _generate(path, **kwargs):
    from lmkit import LLM, SamplingParams

    with LLM(str(path), block_size=16, **kwargs) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24,
                                                    ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_tiny_mixtral_float32_equals_hf_and_graphs_equal_eager(tiny_mixtral):
    path, hf = tiny_mixtral
    got = _generate(path, dtype="float32")
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(
                1, len(prompt), dtype=torch.long), max_new_tokens=24, min_new_tokens=24,
                do_sample=False, pad_token_id=256)
        assert tokens == ref[0, len(prompt):].tolist()
    assert _generate(path, dtype="bfloat16") == _generate(path, dtype="bfloat16",
                                                          enforce_eager=True)
