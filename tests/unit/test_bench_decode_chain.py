"""bench/decode_chain.py on the CPU: its settings (environment variables applied and
restored, the bench-only launch choices) and its refusal of a malformed setting."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import decode_chain  # noqa: E402
import lmkit_plugins.models.fused_ops as fused_ops  # noqa: E402


def test_settings_parse_and_refuse():
    assert decode_chain.parse_setting("default") == {}
    assert decode_chain.parse_setting("LMKIT_PDL=0,TILES=16/512/4/4") == {
        "LMKIT_PDL": "0", "TILES": "16/512/4/4"}
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        decode_chain.parse_setting("LMKIT_PDL")


def test_environment_applies_and_restores(monkeypatch):
    monkeypatch.delenv("LMKIT_PDL", raising=False)
    original = fused_ops.small_m_tiles
    with decode_chain.environment({"LMKIT_PDL": "0", "TILES": "16/256/8/3", "FP8_PIPE": "1",
                                   "FP8_TILES": "4/512/2", "SPLITS": "4"}):
        assert os.environ["LMKIT_PDL"] == "0"
        assert fused_ops.small_m_tiles(4096) == {"block_n": 16, "block_k": 256,
                                                 "num_warps": 8, "num_stages": 3}
        assert decode_chain.FP8_LAUNCH == {"block_n": 4, "block_k": 512, "num_warps": 2,
                                           "pipeline": True}
        assert decode_chain.ATTENTION == {"num_splits": 4}
        assert "TILES" not in os.environ and "SPLITS" not in os.environ
    assert "LMKIT_PDL" not in os.environ and fused_ops.small_m_tiles is original
    with decode_chain.environment({}):  # the defaults
        assert decode_chain.ATTENTION == {} and decode_chain.FP8_LAUNCH["pipeline"] is False
        assert decode_chain.SKIP == set()


def test_per_size_tiles_skips_and_attention_tiles():
    """``TILES<N>`` patches the projections of ``N`` outputs only (plain and folded
    launches), the rest keep the model's choice; ``SKIP`` and ``ATILES`` are the chain's,
    never the environment's; an unknown kind is refused."""
    narrow, plain = fused_ops.narrow_tiles, fused_ops.small_m_tiles
    with decode_chain.environment({"TILES28672": "16/256/8/3", "SKIP": "norm+attn",
                                   "ATILES": "32/4/3"}):
        wide = {"block_n": 16, "block_k": 256, "num_warps": 8, "num_stages": 3}
        assert fused_ops.small_m_tiles(28672) == wide == fused_ops.narrow_tiles(28672)
        assert fused_ops.small_m_tiles(4096) == plain(4096)
        assert fused_ops.narrow_tiles(6144) == narrow(6144)
        assert fused_ops.GemvFold.tiles("silu_mul", 28672) == wide  # not a cached launch
        assert decode_chain.SKIP == {"norm", "attn"}
        assert decode_chain.ATTENTION == {"decode_tiles": (32, 4, 3)}
        assert not any(k.startswith(("TILES", "SKIP", "ATILES")) for k in os.environ)
    assert fused_ops.narrow_tiles is narrow and fused_ops.small_m_tiles is plain
    with pytest.raises(SystemExit, match="SKIP takes"), \
            decode_chain.environment({"SKIP": "rope+lm"}):
        pass
    for bad in ({"ATILES": "32/4"}, {"TILES6144": "64/256/8/x"}, {"SPLITS": "0"},
                {"FP8_TILES": "8/1024"}):
        name = next(iter(bad))
        with pytest.raises(SystemExit, match=f"{name} takes .* joined by '/'"), \
                decode_chain.environment(bad):
            pass
    assert fused_ops.narrow_tiles is narrow and fused_ops.small_m_tiles is plain
