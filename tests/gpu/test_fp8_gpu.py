"""FP8 weights on CUDA (``--quantization fp8``): the kernels against their torch
references at Llama-3.1-8B's projection shapes, both products under CUDA-graph
capture, and the engine's greedy tokens with FP8 weights (quantized at load, and from
a compressed-tensors checkpoint chosen by ``auto``) against the dense bf16 model that
holds the dequantized weights, with CUDA graphs on and off.

Needs a GPU of compute capability 8.9+ (H100, L4, RTX 4090). The model is the
2-layer Llama-8B-shaped copy circuit of :mod:`copy_circuit_model`, whose argmax is
decided by attention with a wide margin: FP8 rounding (about 3% per weight) must not
flip it, so agreement below 99% means a wrong kernel, not noise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_only import require_cuda_and_triton  # noqa: E402

require_cuda_and_triton()
import torch  # noqa: E402

pytestmark = pytest.mark.gpu
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 e4m3 needs compute capability 8.9+", allow_module_level=True)

from copy_circuit_model import llama_config, write_copy_circuit_model  # noqa: E402
from lmkit import LLM, SamplingParams  # noqa: E402
from lmkit_kernels.fp8 import (  # noqa: E402
    fp8_linear_ref,
    quantize_per_channel,
    scaled_mm_linear,
    scaled_mm_ref,
)
from lmkit_kernels.gemv import small_m_linear  # noqa: E402
from lmkit_plugins.quantization.fp8_checkpoint import Fp8Weight  # noqa: E402
from lmkit_plugins.quantization.fp8_cuda import Fp8Linear  # noqa: E402
from lmkit_plugins.quantization.fp8_write import (  # noqa: E402
    write_dequantized,
    write_fp8_checkpoint,
)

#: (out, in) of Llama-3.1-8B's fused QKV, o_proj, fused gate-up and down_proj
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
ENGINE = dict(max_num_seqs=8, max_model_len=2048, num_blocks=1024, device="cuda",
              dtype="bfloat16")
NEW_TOKENS = 32


def _fp8_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    return quantize_per_channel(w)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert got.shape == want.shape and err <= tol, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_gemv_matches_the_reference_at_real_shapes(shape, dtype):
    q, scale = _fp8_weight(*shape)
    bias = torch.randn(shape[0], device="cuda").to(dtype)
    for rows in (1, 4, 16):
        x = torch.randn(rows, shape[1], device="cuda").to(dtype)
        for b in (None, bias):
            for block_n, block_k in ((16, 512), (32, 1024)):
                got = small_m_linear(x, q, b, weight_scale=scale, block_n=block_n,
                                     block_k=block_k)
                _close(got, fp8_linear_ref(x, q, scale, b), 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_one_row_kernel_matches_the_reference_at_real_shapes(shape, dtype):
    from lmkit_kernels.fp8_gemv import fp8_row_linear

    q, scale = _fp8_weight(*shape)
    bias = torch.randn(shape[0], device="cuda").to(dtype)
    x = torch.randn(1, shape[1], device="cuda").to(dtype)
    for b in (None, bias):
        for tiles in ((16, 512, 4), (32, 256, 4), (8, 1024, 8)):
            got = fp8_row_linear(x, q, scale, b, block_n=tiles[0], block_k=tiles[1],
                                 num_warps=tiles[2])
            _close(got, fp8_linear_ref(x, q, scale, b), 1e-2)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_scaled_mm_matches_the_reference_at_real_shapes(shape):
    q, scale = _fp8_weight(*shape)
    for rows in (17, 256, 1000):
        x = torch.randn(rows, shape[1], device="cuda").bfloat16()
        got = scaled_mm_linear(x, q, scale.view(1, -1))
        _close(got, scaled_mm_ref(x, q, scale), 1e-2)
        # and against the unquantized activations: the W8A8 error itself
        _close(got, fp8_linear_ref(x, q, scale), 6e-2)


@pytest.mark.parametrize("k", [4096, 14336])
def test_per_token_quantization_kernel_matches_the_reference(k):
    from lmkit_kernels.fp8 import quantize_per_token, quantize_per_token_ref

    x = torch.randn(300, k, device="cuda").bfloat16() * torch.logspace(
        -3, 2, 300, device="cuda")[:, None].bfloat16()
    xq, scale = quantize_per_token(x)  # the Triton kernel on CUDA
    want_q, want_scale = quantize_per_token_ref(x)
    assert torch.equal(scale, want_scale)
    differ = xq.float() != want_q.float()
    # both divide with IEEE rounding and convert to nearest: at most a stray last bit
    assert float(differ.float().mean()) <= 1e-4
    assert ((xq.float() - want_q.float()).abs() <= want_q.float().abs() / 8 + 2**-9).all()


@pytest.mark.parametrize("rows", [4, 64])  # the GEMV and the _scaled_mm path
def test_both_products_replay_under_cuda_graphs(rows):
    q, scale = _fp8_weight(4096, 4096)
    linear = Fp8Linear(Fp8Weight(q, scale), max_rows=16, block_k=512)
    assert linear.scaled_mm_unsupported is None
    bias = torch.randn(4096, device="cuda").bfloat16()
    x = torch.randn(rows, 4096, device="cuda").bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (Triton compiles, cuBLAS plans) off-graph
        for _ in range(2):
            linear(x, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, bias)
    for seed in (1, 2):
        x.copy_(torch.randn(rows, 4096, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(seed)).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, linear(x, bias))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The copy-circuit model (bf16), its compressed-tensors FP8 checkpoint, and the
    dense bf16 model holding the dequantized FP8 weights."""
    root = tmp_path_factory.mktemp("fp8")
    dense = write_copy_circuit_model(root / "dense", llama_config(2), device="cuda")
    fp8 = write_fp8_checkpoint(dense, root / "fp8", "compressed-tensors", "channel")
    return {"dense": dense, "fp8": fp8,
            "dequantized": write_dequantized(fp8, root / "dequantized", torch.bfloat16)}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128256, (n,), generator=g).tolist() for n in (1, 9, 100, 300)]


def _generate(model_dir: Path, quantization: str, graphs: bool) -> tuple[dict, list[list[int]]]:
    llm = LLM(str(model_dir), quantization=quantization, enforce_eager=not graphs, **ENGINE)
    try:
        runner = llm.engine.executor.runner
        info = {"quantization": llm.engine.stack.names()["quantization"],
                "captured": runner.cuda_graphs is not None}
        outs = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                       ignore_eos=True))
    finally:
        llm.shutdown()
    return info, [list(o.outputs[0].token_ids) for o in outs]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_greedy_tokens_with_fp8_weights(models, graphs):
    info, at_load = _generate(models["dense"], "fp8", graphs)
    assert info == {"quantization": "fp8", "captured": graphs}
    auto_info, from_checkpoint = _generate(models["fp8"], "auto", graphs)
    assert auto_info["quantization"] == "fp8"
    # the checkpoint holds what quantizing at load computes (on the CPU, here on the GPU)
    assert _agreement(from_checkpoint, at_load) >= 0.99, (from_checkpoint, at_load)
    _, reference = _generate(models["dequantized"], "none", graphs)
    agreement = _agreement(at_load, reference)
    print({"graphs": graphs, "agreement_with_dequantized_bf16": agreement})
    assert agreement >= 0.99, (at_load, reference)
