"""``bench/make_kquant_gguf.py``: a Q4_K_M-style copy of a GGUF that the ``gguf`` method
reads, with llama.cpp's choice of types where the rows are whole super-blocks and the
source tensors kept elsewhere; metadata copied; the weights close to the source's."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")
from test_model_sources import write_tiny_llama_gguf  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "make_kquant_gguf.py"
Q = gguf.GGMLQuantizationType


def _q8_0(name: str, data: np.ndarray):
    return gguf.quants.quantize(data, Q.Q8_0), Q.Q8_0


def test_types_follow_q4_k_m_where_rows_allow(tmp_path, monkeypatch, capsys):
    src, out = tmp_path / "src.gguf", tmp_path / "out.gguf"
    # hidden 256: every projection's rows are whole super-blocks but the down
    # projection's (inter 288 values), which keeps its Q8_0
    write_tiny_llama_gguf(src, hidden=256, inter=288, encode=_q8_0)
    monkeypatch.setattr(sys, "argv", ["make_kquant_gguf.py", str(src), str(out)])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    assert "wrote" in capsys.readouterr().out
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))
    types = {t.name: Q(t.tensor_type).name for t in b.tensors}
    # 2 layers: use_more_bits picks layer 1 only (i >= 7 * 2 // 8 = 1)
    assert types["blk.0.attn_v.weight"] == "Q4_K" and types["blk.1.attn_v.weight"] == "Q6_K"
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # 288-value rows: the source's type
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert {f for f in a.fields if not f.startswith("GGUF.")} == {
        f for f in b.fields if not f.startswith("GGUF.")}
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        wa = gguf.quants.dequantize(ta.data, Q(ta.tensor_type))
        wb = gguf.quants.dequantize(tb.data, Q(tb.tensor_type))
        assert ta.name == tb.name and wa.shape == wb.shape
        rel = np.linalg.norm(wa - wb) / max(np.linalg.norm(wa), 1e-30)
        assert rel < 0.12, (ta.name, rel)
