"""SwiGLU in the gate-up projection's epilogue (``glu_out``), compiled on CUDA.

* At Llama-3.1-8B's and SmolLM2-135M's gate-up shapes, 1-8 rows (the layers take it
  up to ``SMALL_BATCH``), with and without bias: :func:`small_m_linear` with
  ``glu_out`` equals the gate-up projection at the same tiles followed by
  :func:`silu_and_mul` bit for bit, and so does the norm fold's (one row, the rows the
  layers fold) with the fold's own output.
* A 2-layer Llama-3.1-8B-shape model (tests/gpu/copy_circuit_model.py) generates the
  same greedy tokens under CUDA graphs with ``LMKIT_GLU_EPILOGUE`` on and off, at batch
  1 and 5 (on: the wave limit lifted, since at this shape the layers keep the separate
  kernel, :func:`~lmkit_plugins.models.fused_ops.glu_epilogue`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_only import require_cuda_and_triton  # noqa: E402

require_cuda_and_triton()
pytestmark = pytest.mark.gpu

import torch  # noqa: E402
from backends import backend_params  # noqa: E402
from copy_circuit_model import (  # noqa: E402
    generate_greedy,
    llama_config,
    write_copy_circuit_model,
)
from lmkit_kernels.activation import silu_and_mul  # noqa: E402
from lmkit_kernels.gemv import small_m_linear  # noqa: E402
from lmkit_plugins.models import fused_ops  # noqa: E402
from lmkit_plugins.models.fused_ops import SMALL_BATCH, GemvFold, small_m_tiles  # noqa: E402

SHAPES = {"llama8b": (4096, 14336), "smollm2": (576, 1536)}  # hidden, intermediate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", range(1, SMALL_BATCH + 1))
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("bias", [False, True])
def test_glu_out_equals_the_separate_kernels(dtype, rows, shape, bias):
    hidden, inter = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(rows)
    kw = {"device": "cuda", "generator": g}
    x = torch.randn(rows, hidden, **kw).to(dtype)
    weight = (0.05 * torch.randn(2 * inter, hidden, **kw)).to(dtype)
    b = torch.randn(2 * inter, **kw).to(dtype) if bias else None
    tiles = small_m_tiles(weight.shape[0])
    want = silu_and_mul(small_m_linear(x, weight, b, **tiles))
    got = small_m_linear(x, weight, b, glu_out=True, **tiles)
    assert torch.equal(got, want)
    if rows == 1:
        residual = torch.randn(rows, hidden, **kw).to(dtype)
        gain = (1 + 0.1 * torch.randn(hidden, **kw)).to(dtype)
        y, h = GemvFold().norm_linear(x, residual, gain, 1e-5, weight, b)
        act, h2 = GemvFold().norm_linear(x, residual, gain, 1e-5, weight, b, glu_out=True)
        assert torch.equal(act, silu_and_mul(y)) and torch.equal(h, h2)


@pytest.fixture(scope="module")
def llama8b_shape(tmp_path_factory) -> Path:
    return write_copy_circuit_model(tmp_path_factory.mktemp("llama8b_glu"), llama_config(2),
                                    device="cuda")


@pytest.mark.parametrize("backend", backend_params("triton", "flashinfer"))
def test_greedy_tokens_equal_with_the_epilogue_on_and_off(llama8b_shape, backend, monkeypatch):
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, 128256, (n,), generator=g).tolist() for n in (1, 17, 100, 300, 33)]
    prompt_sets = [batch[2:3], batch]  # decode at batch 1, then at batch 5
    monkeypatch.delenv("LMKIT_GLU_EPILOGUE", raising=False)
    monkeypatch.setattr(fused_ops, "GLU_MAX_PROGRAMS_PER_SM", 1 << 20)
    on, model = generate_greedy(llama8b_shape, backend, prompt_sets)
    assert all(layer.mlp.gate_up_proj.glu for layer in model.model.layers)
    monkeypatch.setenv("LMKIT_GLU_EPILOGUE", "0")
    off, model = generate_greedy(llama8b_shape, backend, prompt_sets)
    assert not any(layer.mlp.gate_up_proj.glu for layer in model.model.layers)
    assert on == off
