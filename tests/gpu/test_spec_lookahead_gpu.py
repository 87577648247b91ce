"""Verifications launched ahead (:mod:`lmkit.worker.spec_lookahead`) on CUDA with
captured graphs: on the tiny random Llama with random ``eagle`` / ``eagle3`` heads
and a head whose constant draft is often accepted (float32, triton attention), greedy
outputs equal plain decoding and every draft equals the run with
``LMKIT_SPEC_LOOKAHEAD=0``, with launched steps taken (whole and for a subset of their
requests) and discarded (drafts cut at ``max_tokens``), most of them taken with the
next drafts made by a device step (:mod:`lmkit.worker.spec_device_step`), and the same
with device steps off."""

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

MAX_TOKENS = [9, 14, 40, 17, 33]


@pytest.mark.parametrize("proposer", ["eagle", "eagle3", "accepting"])
def test_verifications_launched_ahead_on_cuda(tmp_path, monkeypatch, proposer):
    from lmkit.worker.spec_lookahead import SpecLookahead

    made = instances(monkeypatch, SpecLookahead)
    tiny = make_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    assert len(params) == len(PROMPTS)
    plain, _, _ = _run(tiny, None, "eagle", monkeypatch, speculative=False, params=params)
    if proposer == "accepting":  # drafts the token the outputs hold most often
        from collections import Counter

        common = Counter(t for out in plain.values() for t in out).most_common(1)[0][0]
        head = make_tiny_eagle_head(tmp_path / "head", tiny, constant_draft=common)
        proposer = "eagle"
    elif proposer == "eagle":
        head = make_tiny_eagle_head(tmp_path / "head", tiny, layer_std=0.3)
    else:
        head = make_tiny_eagle3_head(tmp_path / "head", tiny)
    monkeypatch.setenv("LMKIT_SPEC_LOOKAHEAD", "0")
    off, off_drafts, _ = _run(tiny, head, proposer, monkeypatch, params=params)
    assert made == [] and off == plain
    monkeypatch.delenv("LMKIT_SPEC_LOOKAHEAD")
    on, on_drafts, _ = _run(tiny, head, proposer, monkeypatch, params=params)
    assert len(made) == 1 and made[0].stats.used > 10 and made[0].stats.discarded > 0
    assert made[0].stats.stepped > made[0].stats.used // 2
    # every request count up to the limit that fits the graphs: captured at start
    step = made[0].device_step
    sizes = step.captured_sizes
    bound = min(step.max_requests, step.graphs.max_num_seqs)
    assert len(sizes) >= min(4, bound) and sizes == list(range(1, len(sizes) + 1))
    assert len(sizes) == bound or not step.fits_rows(len(sizes) + 1)
    assert on == plain
    assert len(on_drafts) > 20 and on_drafts == off_drafts
    monkeypatch.setenv("LMKIT_SPEC_DEVICE_STEP", "0")
    host, host_drafts, _ = _run(tiny, head, proposer, monkeypatch, params=params)
    assert made[1].device_step is None and made[1].stats.used > 10
    assert host == plain and host_drafts == off_drafts
