"""Structured output on CUDA: xgrammar's bitmask kernel and lmkit's torch version on the
GPU against the token-by-token reference, and constrained generation with SmolLM2 in
bf16 (CUDA graphs on) whose outputs all validate. SmolLM2 comes from
``LMKIT_TEST_SMOLLM2`` (its GGUF file or converted directory) or the ``smollm2_dir``
fixture."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from lmkit import LLM, SamplingParams  # noqa: E402
from lmkit.sample.bitmask import apply_token_bitmask  # noqa: E402
from lmkit_plugins.structured.xgrammar_backend import XGrammarBackend  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_structured_output import SCHEMAS  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("indices", [None, [0, 5, 6]])
def test_cuda_kernels_match_the_cpu_version(dtype, indices):
    """(The CPU torch version is checked token by token against the reference in
    tests/unit/test_structured_bitmask.py.)"""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 49152, generator=g).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (8, 1536), dtype=torch.int32, generator=g)
    bitmask[1] = 0  # a row that allows nothing
    expected = logits.clone()
    apply_token_bitmask(expected, bitmask, indices)
    for kernel in (XGrammarBackend.apply_token_bitmask, apply_token_bitmask):
        out = logits.cuda()
        kernel(out, bitmask.cuda(), indices)
        assert torch.equal(out.cpu(), expected)


def test_constrained_generation_on_cuda_validates(smollm2):
    names = list(SCHEMAS)
    with LLM(str(smollm2), device="cuda", dtype="bfloat16", max_num_seqs=64,
             max_model_len=512) as llm:
        params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=80,
                                 structured_outputs={"json": SCHEMAS[n]})
                  for i, n in enumerate(names)]
        outs = llm.chat([[{"role": "user", "content": f"Reply with a JSON {n}."}]
                         for n in names], params)
    for name, out in zip(names, outs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[name])
