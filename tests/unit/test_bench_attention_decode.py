"""bench/attention_decode.py on the CPU: the per-sequence contexts it builds (one length
for all, or drawn from a range with a fixed seed) and its refusal of a bad range."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import attention_decode  # noqa: E402


def _args(**kw):
    return argparse.Namespace(**{"num_seqs": 64, "context": 4096, "context_range": "", **kw})


def test_contexts_fixed_or_drawn_from_a_range():
    assert attention_decode.context_lengths(_args()) == [4096] * 64
    drawn = attention_decode.context_lengths(_args(num_seqs=256, context_range="200,2048"))
    assert len(drawn) == 256 and min(drawn) >= 200 and max(drawn) <= 2048
    assert len(set(drawn)) > 100  # mixed lengths, not one
    assert drawn == attention_decode.context_lengths(_args(num_seqs=256,
                                                           context_range="200,2048"))


@pytest.mark.parametrize("bad", ["200", "0,10", "10,5", "a,b"])
def test_a_bad_range_is_refused(bad):
    with pytest.raises(SystemExit, match="--context-range: expected LO,HI"):
        attention_decode.context_lengths(_args(context_range=bad))


def test_decode_tiles_parse_and_refuse():
    assert attention_decode.parse_tiles("64/4/3, 128/4/2") == [[64, 4, 3], [128, 4, 2]]
    assert attention_decode.parse_tiles("") == []
    with pytest.raises(SystemExit, match="BLOCK_N/warps/stages"):
        attention_decode.parse_tiles("64/4")
