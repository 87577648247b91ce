"""The fused MoE kernel (:func:`lmkit_kernels.moe.fused_moe`) against its torch
reference (:func:`lmkit_kernels.moe_ref.fused_moe_ref`) in Triton's CPU interpreter, at
tiny shapes: float32/float16/bfloat16, top-1/2/3, experts that get no token, ragged
hidden and intermediate sizes (masked tiles), 16- and 32-row blocks, and the
expert-sorted layout :func:`~lmkit_kernels.moe.moe_align` builds. The compiled kernel
runs at a Mixtral-8x7B shape in tests/gpu/test_moe_gpu.py.
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter()
torch = pytest.importorskip("torch")

from lmkit_kernels.interpreter import bf16_round_to_nearest  # noqa: E402
from lmkit_kernels.moe import fused_moe, moe_align  # noqa: E402
from lmkit_kernels.moe_ref import fused_moe_ref  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _problem(tokens, hidden, inter, experts, top_k, dtype, seed=0, unused=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    for e in unused:
        logits[:, e] = -1e9  # never chosen
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


@pytest.fixture(autouse=True)
def gpu_rounding():
    with bf16_round_to_nearest() as patched:
        yield patched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "top_k", "block_m"), [(1, 2, 16), (13, 2, 16), (9, 3, 32)])
def test_fused_moe_matches_reference(dtype, tokens, top_k, block_m):
    x, w13, w2, weights, ids = _problem(tokens, 48, 40, 5, top_k, dtype)
    out = fused_moe(x, w13, w2, weights, ids, block_m=block_m, block_n=16, block_k=16)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_experts_without_tokens_and_default_blocks():
    # experts 1 and 3 get no token; the default block size; top-1
    x, w13, w2, weights, ids = _problem(21, 32, 24, 4, 1, torch.float32, seed=3, unused=(1, 3))
    assert not bool(((ids == 1) | (ids == 3)).any())
    out = fused_moe(x, w13, w2, weights, ids, block_n=16, block_k=16)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), atol=1e-5,
                               rtol=1e-5)


def test_reference_is_the_weighted_sum_of_dense_experts():
    """The reference itself: every token's output is its experts' SwiGLU outputs, each
    times its router weight, summed (computed here one token at a time)."""
    x, w13, w2, weights, ids = _problem(6, 16, 8, 3, 2, torch.float64, seed=5)
    out = fused_moe_ref(x, w13, w2, weights.double(), ids)
    for t in range(6):
        want = torch.zeros(16, dtype=torch.float64)
        for k in range(2):
            gate, up = (w13[ids[t, k]] @ x[t]).chunk(2)
            want += weights[t, k] * (w2[ids[t, k]] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], want)


def test_moe_align_groups_pairs_by_expert():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0]])
    sorted_ids, block_experts, num_padded = moe_align(ids, num_experts=4, block_m=4)
    n = ids.numel()
    used = int(num_padded.item())
    assert used == 12  # experts 0, 1, 2 each padded to one 4-row block; expert 3 none
    assert sorted_ids.numel() % 4 == 0 and sorted_ids.numel() >= used
    flat = ids.reshape(-1)
    seen = []
    for b in range(used // 4):
        rows = sorted_ids[b * 4:(b + 1) * 4]
        real = rows[rows < n]
        assert bool((flat[real.long()] == block_experts[b]).all())
        assert real.tolist() == sorted(real.tolist())  # stable: pair order kept
        seen += real.tolist()
    assert sorted(seen) == list(range(n))  # every pair exactly once
    assert bool((sorted_ids[used:] == n).all())


def test_argument_checks():
    x, w13, w2, weights, ids = _problem(3, 16, 8, 2, 1, torch.float32)
    with pytest.raises(ValueError, match="w2 must have shape"):
        fused_moe(x, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError, match="must have x's dtype"):
        fused_moe(x, w13.half(), w2, weights, ids)
    with pytest.raises(ValueError, match="integer expert ids"):
        fused_moe(x, w13, w2, weights, weights)
    with pytest.raises(ValueError, match=r"must both be \[3, top_k\]"):
        fused_moe(x, w13, w2, weights[:2], ids[:2])
    empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 16)


@pytest.mark.parametrize("family", ["mixtral", "v3"])
def test_moe_block_on_the_fused_kernel_matches_hf(family):
    """The layer as it runs on CUDA (router, stacked ``w13``/``w2`` loaded from
    checkpoint names, the fused kernel, shared experts) against transformers' block:
    Mixtral's top-2 softmax, and DeepSeek-V3's grouped sigmoid top-4 of 16 with its
    correction bias, scaling factor and shared expert."""
    pytest.importorskip("transformers")
    from moe_hf import hf_moe_block, sparse_moe_like

    cfg, hf = hf_moe_block(family)
    block = sparse_moe_like(cfg, hf)
    block._experts = fused_moe  # what SparseMoE picks on CUDA (fused_moe_enabled)
    x = torch.randn(19, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = hf(x[None])[0]
        got = block(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_moe_experts_routes_large_batches_to_the_reference(monkeypatch):
    """Both routes of a MoE layer's experts give the reference's result; the fused
    kernel runs below the rows-per-expert threshold, the grouped reference from it on."""
    from lmkit_plugins.models.fused_ops import (
        FUSED_MOE_MAX_ROWS_PER_EXPERT,
        MOE_ROWS_ENV,
        MoEExperts,
        moe_experts,
        moe_max_rows_per_expert,
    )
    calls = []

    def spy(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    def fused(*args):
        return fused_moe(*args, block_n=16, block_k=16)

    experts = MoEExperts(spy("fused", fused), spy("reference", fused_moe_ref),
                         max_rows_per_expert=4)  # 5 experts: fused below 20 rows
    for tokens, route in ((9, "fused"), (10, "reference"), (13, "reference")):
        x, w13, w2, weights, ids = _problem(tokens, 48, 40, 5, 2, torch.bfloat16, seed=tokens)
        out = experts(x, w13, w2, weights, ids)
        assert calls[-1] == route
        torch.testing.assert_close(out.float(), fused_moe_ref(x, w13, w2, weights, ids).float(),
                                   atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    default = MoEExperts(fused, fused_moe_ref)  # 256 rows per expert
    assert default.uses_fused(1023, 2, 8) and not default.uses_fused(1024, 2, 8)
    assert moe_experts("cpu") is fused_moe_ref  # no CUDA: the reference only
    monkeypatch.delenv(MOE_ROWS_ENV, raising=False)
    assert moe_max_rows_per_expert() == FUSED_MOE_MAX_ROWS_PER_EXPERT == 256
    monkeypatch.setenv(MOE_ROWS_ENV, "512")
    assert moe_max_rows_per_expert() == 512
    monkeypatch.setenv(MOE_ROWS_ENV, "lots")
    with pytest.raises(ValueError, match="expected a non-negative integer"):
        moe_max_rows_per_expert()


def test_large_tiles_match_reference():
    """The large-tile configuration bench/moe_kernel.py times (128 x 128, BLOCK_K 64), over
    ragged sizes smaller than one tile (masked)."""
    x, w13, w2, weights, ids = _problem(70, 48, 40, 4, 2, torch.bfloat16, seed=9)
    out = fused_moe(x, w13, w2, weights, ids, block_m=128, block_n=128, block_k=64,
                    num_warps=8, num_stages=3)
    torch.testing.assert_close(out.float(), fused_moe_ref(x, w13, w2, weights, ids).float(),
                               atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
