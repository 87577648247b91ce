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


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Units in the last place between two bfloat16/float16 tensors (elementwise)."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def _same_bits(what: str, got: torch.Tensor, want: torch.Tensor, max_ulp: int) -> None:
    """``got`` is ``want`` up to ``max_ulp`` units in the last place, at least 98% of it
    bit for bit (printed: ``pytest -s``)."""
    ulps = _ulps(got, want)
    same = (ulps == 0).float().mean().item()
    print(f"{what}: {same:.4%} bit-identical, max {ulps.max().item()} ulp")
    assert got.shape == want.shape and ulps.max().item() <= max_ulp and same >= 0.98, what


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tiles", [(8, 1024, 4), (16, 512, 4)], ids=["8x1024", "16x512"])
def test_pipelined_one_row_kernel_is_the_plain_one(dtype, tiles):
    from lmkit_kernels.fp8_gemv import fp8_row_linear

    launch = {"block_n": tiles[0], "block_k": tiles[1], "num_warps": tiles[2]}
    for shape in SHAPES:
        q, scale = _fp8_weight(*shape)
        x = torch.randn(1, shape[1], device="cuda").to(dtype)
        # the same products summed in the same order: bit for bit (allowing one ulp
        # in case the compiler reduces the accumulator in another order)
        _same_bits(f"pipelined {shape} {tiles}",
                   fp8_row_linear(x, q, scale, pipeline=True, **launch),
                   fp8_row_linear(x, q, scale, **launch), 1)


def _fold_matches(what: str, got: torch.Tensor, want: torch.Tensor, block_n: int,
                  max_ulp: int) -> None:
    """At the separate kernel's tiles: :func:`_same_bits`. At other rows per program
    (``gemv_row_fold_block_n``) the final sum across the K slice may run in another
    order: at least 98% bit-identical, the rest within float rounding of the sums."""
    if block_n == 8:
        _same_bits(what, got, want, max_ulp)
        return
    same = (_ulps(got, want) == 0).float().mean().item()
    print(f"{what} (block_n {block_n}): {same:.4%} bit-identical")
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3 * scale)
    assert same >= 0.98, what


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipelined"])
@pytest.mark.parametrize("block_n", [8, 16])
@pytest.mark.parametrize(("n", "with_residual", "bias"),
                         [(6144, True, False), (6144, False, True), (28672, True, False)])
def test_fp8_norm_fold_at_llama8b_shapes(dtype, pipeline, block_n, n, with_residual, bias):
    """Against rms_norm then the one-row kernel with the default tiles: the residual sum
    bit for bit, the output within one ulp (the norm's sum of squares may be reduced in
    another order, so 1 / rms may differ in its last bit)."""
    from lmkit_kernels.fp8_gemv import fp8_row_linear
    from lmkit_kernels.fp8_gemv_fold import norm_fp8_row_linear
    from lmkit_kernels.norm import rms_norm

    g = torch.Generator(device="cuda").manual_seed(n)
    kw = {"device": "cuda", "generator": g}
    x = torch.randn(1, 4096, **kw).to(dtype)
    residual = (4 * torch.randn(1, 4096, **kw)).to(dtype) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(4096, **kw)).to(dtype)
    q, scale = _fp8_weight(n, 4096)
    b = torch.randn(n, **kw).to(dtype) if bias else None
    out, h = norm_fp8_row_linear(x, residual, norm_weight, 1e-5, q, scale, b,
                                 pipeline=pipeline, block_n=block_n)
    if residual is None:
        normed, want_h = rms_norm(x, norm_weight, 1e-5), x
    else:
        normed, want_h = rms_norm(x, norm_weight, 1e-5, residual)
    assert torch.equal(h, want_h)
    _fold_matches(f"fp8 norm fold -> {n}", out, fp8_row_linear(normed, q, scale, b),
                  block_n, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipelined"])
@pytest.mark.parametrize("block_n", [8, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_silu_fold_at_llama8b_shapes(dtype, pipeline, block_n, bias):
    """Against silu_and_mul then the one-row kernel: bit for bit (the same roundings)."""
    from lmkit_kernels.activation import silu_and_mul
    from lmkit_kernels.fp8_gemv import fp8_row_linear
    from lmkit_kernels.fp8_gemv_fold import silu_mul_fp8_row_linear

    g = torch.Generator(device="cuda").manual_seed(7)
    gate_up = (3 * torch.randn(1, 2 * 14336, device="cuda", generator=g)).to(dtype)
    q, scale = _fp8_weight(4096, 14336)
    b = torch.randn(4096, device="cuda", generator=g).to(dtype) if bias else None
    out = silu_mul_fp8_row_linear(gate_up, q, scale, b, pipeline=pipeline, block_n=block_n)
    _fold_matches("fp8 silu fold", out, fp8_row_linear(silu_and_mul(gate_up), q, scale, b),
                  block_n, 1 if pipeline else 0)


def test_pdl_chain_replays_under_cuda_graphs():
    """A decode layer's FP8 chain (norm fold, plain, norm fold, SiLU fold), launched with
    programmatic dependent launch where the GPU has it, captured and replayed: each
    kernel reads its predecessor's output, so a missing wait would show as a stale read."""
    from lmkit_kernels.fp8_gemv import fp8_row_linear
    from lmkit_kernels.fp8_gemv_fold import norm_fp8_row_linear, silu_mul_fp8_row_linear

    qkv, o, gate_up, down = (_fp8_weight(n, k, seed) for seed, (n, k) in enumerate(SHAPES))
    norm_weight = torch.ones(4096, device="cuda").bfloat16()
    x = torch.randn(1, 4096, device="cuda").bfloat16()

    def layer(x):
        a, res = norm_fp8_row_linear(x, None, norm_weight, 1e-5, *qkv)
        hidden = fp8_row_linear(a[:, :4096].contiguous(), *o)
        g, res = norm_fp8_row_linear(hidden, res, norm_weight, 1e-5, *gate_up)
        return silu_mul_fp8_row_linear(g, *down), res

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            layer(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = layer(x)
    for seed in (1, 2):
        x.copy_(torch.randn(1, 4096, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(seed)).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        want, want_res = layer(x)
        assert torch.equal(out, want) and torch.equal(res, want_res)


def _generate_folded(model_dir: Path) -> tuple[list[bool], list[list[int]]]:
    llm = LLM(str(model_dir), quantization="fp8", **ENGINE)
    try:
        runner = llm.engine.executor.runner
        assert runner.cuda_graphs is not None
        folded = [layer.self_attn.qkv_proj._qnorm is not None
                  and layer.mlp.down_proj._qsilu is not None
                  for layer in runner.model.model.layers]
        outs = llm.generate(_prompts()[:1], SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))  # batch 1: folded
        outs += llm.generate(_prompts(), SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))  # batch 4: not
    finally:
        llm.shutdown()
    return folded, [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_tokens_with_the_fp8_fold_on_and_off(models, monkeypatch):
    """Under CUDA graphs, both folds on (``LMKIT_GEMV_FOLD=1``) and off (``=0``)."""
    monkeypatch.setenv("LMKIT_GEMV_FOLD", "1")  # both folds (unset: the norm fold only)
    folded, on = _generate_folded(models["dense"])
    monkeypatch.setenv("LMKIT_GEMV_FOLD", "0")
    unfolded, off = _generate_folded(models["dense"])
    assert all(folded) and not any(unfolded)
    agreement = _agreement(on, off)
    print({"fold_on_vs_off_agreement": agreement})
    assert agreement >= 0.99, (on, off)
