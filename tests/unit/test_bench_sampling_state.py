"""bench/sampling_state.py: each parameter mix runs through the runner's sampling path
(with its per-request cache) on tiny shapes; an unknown mix is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import sampling_state  # noqa: E402


@pytest.mark.parametrize("mix", sampling_state.MIXES)
def test_each_mix_times_a_step(mix):
    assert sampling_state.time_steps(mix, 3, 2, 2200, 6, 4, "cpu") > 0


def test_an_unknown_mix_is_refused():
    with pytest.raises(SystemExit, match="choose from penalties"):
        sampling_state.mix_params("greedy", 0)


def test_the_working_tree_side_penalises_with_the_chosen_kernels(monkeypatch):
    pytest.importorskip("triton")
    from lmkit_kernels.checks import is_interpreting
    from lmkit_plugins.sampling import triton_kernels

    if not is_interpreting():
        pytest.skip("the Triton kernels run on the CPU only in Triton's interpreter")
    launches = []
    kernel = triton_kernels.triton_penalties
    monkeypatch.setattr(triton_kernels, "triton_penalties",
                        lambda *a, **k: launches.append(1) or kernel(*a, **k))
    assert sampling_state.time_steps("penalties", 3, 2, 600, 6, 4, "cpu", "torch") > 0
    assert launches == []
    assert sampling_state.time_steps("penalties", 3, 2, 600, 6, 4, "cpu", "triton") > 0
    assert len(launches) == 5  # 3 warm-up steps, 2 timed
