"""Rows of the input batch that grow mid-serving on CUDA (bf16, triton, CUDA graphs,
the decode lookahead, ngram drafts through the flattened graphs): tokens equal the run
whose rows were wide from the start (tests/unit/test_input_batch_growth.py on the CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_only import require_cuda_and_triton  # noqa: E402

require_cuda_and_triton()
pytestmark = pytest.mark.gpu

from lmkit import LLM, SamplingParams  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402
from lmkit.worker import input_batch  # noqa: E402


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_rows_growing_on_cuda_keep_the_tokens(tmp_path, monkeypatch, speculative):
    model = str(make_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2))
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 200 for j in range(n)]}
               for i, n in enumerate((3, 40, 7, 90))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (120, 60, 150, 30)]
    spec = dict(speculative=speculative, num_speculative_tokens=3) if speculative else {}

    def run() -> tuple[list[list[int]], int]:
        with LLM(model, device="cuda", dtype="bfloat16", attention="triton",
                 max_model_len=512, block_size=16, progress=False, **spec) as llm:
            outs = llm.generate(prompts, params)
            width = llm.engine.executor.runner.input_batch.token_ids.shape[1]
            return [list(o.outputs[0].token_ids) for o in outs], width

    wide, width = run()
    assert width == 513
    monkeypatch.setattr(input_batch, "INITIAL_ROW_TOKENS", 8)
    grown, width = run()
    assert width == 288  # 9 at first, doubled to hold 7 + 150 tokens (and drafts)
    assert grown == wide
