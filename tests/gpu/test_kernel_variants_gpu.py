"""Index arrays passed as views at any offset must not compile a second kernel variant.

Triton specialises a pointer argument on its 16-byte alignment unless told not to; a
slot mapping or position array sliced at an odd element (the speculative path's steps
do) then compiles a new variant, about a second in the middle of serving (seen: the
first EAGLE-3 request on an H200, `bench/spec_decode.py`'s JIT report). Each kernel that
reads such an array one element per program is called with an aligned array, then
with a view one element in, and must hit the variant it already has.
"""

from __future__ import annotations

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from lmkit_kernels.cache_write import reshape_and_cache  # noqa: E402
from lmkit_kernels.mla_cache_write import mla_cache_write  # noqa: E402
from lmkit_kernels.reference import reshape_and_cache_ref  # noqa: E402
from lmkit_kernels.rotary import rotary_qk_  # noqa: E402
from lmkit_kernels.rotary_cos_sin import rotary_cos_sin, rotary_cos_sin_ref  # noqa: E402
from triton import knobs  # noqa: E402

CUDA = torch.device("cuda")


@pytest.fixture
def compiles():
    """The kernels Triton compiles (cache misses) while the test runs."""
    seen: list[str] = []
    before = knobs.runtime.jit_cache_hook

    def hook(*, repr: str, **_):
        seen.append(repr.split("[")[0])
        return False

    knobs.runtime.jit_cache_hook = hook
    yield seen
    knobs.runtime.jit_cache_hook = before


def _offset_view(values: list[int], dtype=torch.int64) -> torch.Tensor:
    """``values`` on the GPU as a view one element into a larger array (8 bytes off a
    16-byte boundary for int64)."""
    t = torch.tensor([-1, *values], dtype=dtype, device=CUDA)[1:]
    assert t.data_ptr() % 16 != 0
    return t


def test_cache_write_takes_a_slot_view_without_a_new_variant(compiles):
    torch.manual_seed(0)
    cache = torch.zeros(2, 8, 16, 3, 64, dtype=torch.bfloat16, device=CUDA)
    k, v = (torch.randn(5, 3, 64, dtype=torch.bfloat16, device=CUDA) for _ in range(2))
    reshape_and_cache(k, v, cache, torch.tensor([0, 1, 2, 3, 4], device=CUDA))
    compiles.clear()
    slots = _offset_view([17, 40, 3, 90, 127])
    reshape_and_cache(k, v, cache, slots)
    assert compiles == []
    expected = torch.zeros_like(cache)
    reshape_and_cache_ref(k, v, expected, torch.tensor([0, 1, 2, 3, 4], device=CUDA))
    reshape_and_cache_ref(k, v, expected, slots.clone())
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_mla_cache_write_takes_a_slot_view_without_a_new_variant(compiles):
    cache = torch.zeros(4, 16, 512 + 64, dtype=torch.bfloat16, device=CUDA)
    kv_c = torch.randn(3, 512, dtype=torch.bfloat16, device=CUDA)
    k_pe = torch.randn(3, 64, dtype=torch.bfloat16, device=CUDA)
    mla_cache_write(kv_c, k_pe, cache, torch.tensor([0, 1, 2], device=CUDA))
    compiles.clear()
    mla_cache_write(kv_c, k_pe, cache, _offset_view([20, 33, 63]))
    assert compiles == []
    for slot, row in zip((20, 33, 63), range(3), strict=True):
        torch.testing.assert_close(cache.view(-1, 576)[slot],
                                   torch.cat([kv_c[row], k_pe[row]]), rtol=0, atol=0)


def test_rotary_cache_write_takes_a_slot_view_without_a_new_variant(compiles):
    heads, kv_heads, size = 9, 3, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, size, 2, device=CUDA).float() / size))
    cos, sin = rotary_cos_sin(torch.arange(4, device=CUDA), inv_freq, torch.bfloat16)
    cache = torch.zeros(2, 4, 16, kv_heads, size, dtype=torch.bfloat16, device=CUDA)

    def run(slots):
        qkv = torch.randn(4, (heads + 2 * kv_heads) * size, dtype=torch.bfloat16, device=CUDA)
        rotary_qk_(qkv, cos, sin, num_heads=heads, num_kv_heads=kv_heads, head_size=size,
                   kv_cache=cache, slot_mapping=slots)
        return qkv

    run(torch.tensor([0, 1, 2, 3], device=CUDA))
    compiles.clear()
    qkv = run(_offset_view([40, 41, 42, 43]))
    assert compiles == []
    values = qkv[:, (heads + kv_heads) * size:].view(4, kv_heads, size)
    torch.testing.assert_close(cache[1].view(-1, kv_heads, size)[40:44], values, rtol=0, atol=0)


def test_cos_sin_takes_a_position_view_without_a_new_variant(compiles):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, device=CUDA).float() / 64))
    rotary_cos_sin(torch.arange(6, device=CUDA), inv_freq, torch.bfloat16)
    compiles.clear()
    positions = _offset_view([5, 9, 200, 301])
    cos, sin = rotary_cos_sin(positions, inv_freq, torch.bfloat16)
    assert compiles == []
    ref_cos, ref_sin = rotary_cos_sin_ref(positions.clone(), inv_freq, torch.bfloat16)
    torch.testing.assert_close(cos.float(), ref_cos.float(), rtol=0, atol=1e-2)
    torch.testing.assert_close(sin.float(), ref_sin.float(), rtol=0, atol=1e-2)


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9}, {"top_k": 40, "top_p": 0.95}])
def test_sampling_compiles_once_for_every_batch_size(compiles, filters):
    """The sampling kernels' chunking follows the batch size (as arguments, not constants):
    a batch that drains from 256 rows to 1 compiles no variant after the first call
    (before session 29: one per new batch size, 54 in the middle of a W1 run)."""
    from lmkit_kernels.sampling import sample

    torch.manual_seed(0)
    vocab = 151936

    def draw(rows: int) -> torch.Tensor:
        logits = torch.randn(rows, vocab, device=CUDA)
        args = {name: torch.full((rows,), value, device=CUDA) for name, value in filters.items()}
        if "top_k" in args:
            args["top_k"] = args["top_k"].to(torch.int64)
        out = sample(logits, temperature=torch.full((rows,), 0.8, device=CUDA), **args)
        assert out.shape == (rows,) and bool(((out >= 0) & (out < vocab)).all())
        return out

    draw(256)
    compiles.clear()
    for rows in (255, 200, 128, 97, 64, 33, 17, 16, 9, 5, 2, 1):
        draw(rows)
    assert compiles == []
