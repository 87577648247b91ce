"""``lmkit_kernels.argmax.argmax_rows`` under Triton's CPU interpreter: exactly
``torch.argmax(x, dim=-1)``, ties, NaN and ``-inf`` rows included (the compiled kernel:
tests/gpu/test_kernels_gpu.py)."""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu")
torch = pytest.importorskip("torch")

from lmkit_kernels.argmax import BLOCK, argmax_rows  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 37, BLOCK, 2 * BLOCK + 5])
def test_random_rows(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(3, vocab, generator=g).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_take_the_first_index_across_chunks():
    x = torch.zeros(4, 2 * BLOCK + 5)
    x[0, [5, BLOCK + 1, 2 * BLOCK + 4]] = 3.0  # equal maxima in three chunks
    x[1, [BLOCK + 7, BLOCK + 3]] = 2.0  # two in one chunk
    x[2, :] = float("-inf")  # nothing larger than -inf: index 0
    x[3, [BLOCK + 1, 9]] = float("inf")
    assert argmax_rows(x).tolist() == [5, BLOCK + 3, 0, 9] == x.argmax(dim=-1).tolist()


def test_nan_wins_as_in_torch():
    x = torch.randn(3, 2 * BLOCK)
    x[0, BLOCK + 2] = float("nan")
    x[0, 3] = float("inf")
    x[1, [7, BLOCK + 9]] = float("nan")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[:2].tolist() == [BLOCK + 2, 7]


def test_strided_rows_and_refusals():
    x = torch.randn(4, 300)[:, :200]  # rows strided, last dim contiguous
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(torch.zeros(0, 10)).shape == (0,)
    with pytest.raises(ValueError, match="at least one element"):
        argmax_rows(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="x"):
        argmax_rows(torch.zeros(2, 3, 4))
