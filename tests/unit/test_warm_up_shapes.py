"""The warm-up step shapes (run at startup on CUDA, so JIT kernels compile there and
not mid-run) include every LM-head row count class Triton specialises: one row alone
(an argument equal to 1 is its own variant) and several."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from lmkit.worker import dummy_steps


def test_warm_up_runs_one_request_alone_and_mixed_batches(monkeypatch):
    seen: list[tuple[list[int], list[int]]] = []
    monkeypatch.setattr(dummy_steps, "dummy_step",
                        lambda runner, q, c: seen.append((q.tolist(), c.tolist())))
    runner = SimpleNamespace(
        scheduler=SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=256),
        max_model_len=4096, device=torch.device("cpu"))
    dummy_steps.warm_up_step_shapes(runner)
    logit_rows = {len(q) for q, _ in seen}  # each request's last token gets logits
    assert 1 in logit_rows and max(logit_rows) > 1
    assert ([1], [12]) in seen  # the lone decode the last request of a batch meets
    for q, c in seen:
        assert sum(q) <= 2048 and all(a + b <= 4096 for a, b in zip(q, c, strict=True))
        assert np.all(np.array(q) >= 1)
