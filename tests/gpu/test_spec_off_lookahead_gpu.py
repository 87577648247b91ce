"""Speculation off by batch size (``speculative.disable_by_batch_size``) on CUDA with
captured graphs: the decode steps of batches above the limit run ahead
(:mod:`lmkit.worker.gpu_lookahead`), the draft head's catch-up over each queued at its
launch (:mod:`lmkit.worker.launch_catch_up`); once the batch shrinks to the limit the
head drafts, and every draft equals the run without the lookahead
(``LMKIT_DECODE_LOOKAHEAD=0``) while the outputs equal plain decoding. With ``catch_up_when_off: false`` the head drafts nothing and the steps still
run ahead once the batch is at the limit."""

from __future__ import annotations

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from eagle_engine import PROMPTS, instances  # noqa: E402
from eagle_engine import run_engine as _run  # noqa: E402
from lmkit import SamplingParams  # noqa: E402
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402

# five requests (speculation off), then two (drafting) once three have finished
MAX_TOKENS = [8, 12, 40, 16, 40]
OFF_ABOVE = {"disable_by_batch_size": 2}


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_steps_off_by_batch_size_run_ahead_on_cuda(tmp_path, monkeypatch, proposer):
    from lmkit.worker.gpu_lookahead import DecodeLookahead

    made = instances(monkeypatch, DecodeLookahead)
    tiny = make_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    assert len(params) == len(PROMPTS)
    plain, _, _ = _run(tiny, None, proposer, monkeypatch, speculative=False, params=params)
    head = (make_tiny_eagle_head(tmp_path / "head", tiny, layer_std=0.3) if proposer == "eagle"
            else make_tiny_eagle3_head(tmp_path / "head", tiny))
    made.clear()
    monkeypatch.setenv("LMKIT_DECODE_LOOKAHEAD", "0")
    off, off_drafts, _ = _run(tiny, head, proposer, monkeypatch, params=params,
                              settings=OFF_ABOVE)
    assert made == [] and off == plain
    monkeypatch.delenv("LMKIT_DECODE_LOOKAHEAD")
    on, on_drafts, _ = _run(tiny, head, proposer, monkeypatch, params=params, settings=OFF_ABOVE)
    stats = made[0].stats
    assert len(made) == 1 and stats.used > 5
    # each launched step's catch-up queued behind it (lmkit.worker.launch_catch_up)
    assert made[0].drafter.num_launch_catch_ups >= stats.used
    assert on == plain
    assert len(on_drafts) > 10 and on_drafts == off_drafts
    dropped, dropped_drafts, _ = _run(tiny, head, proposer, monkeypatch, params=params,
                                      settings={**OFF_ABOVE, "catch_up_when_off": False})
    assert dropped == plain and dropped_drafts == {}
    assert made[1].stats.used > 25
