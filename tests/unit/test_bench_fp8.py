"""The FP8 benchmarks on the CPU: bench/gpu_engine.py's byte accounting with
``--quantization fp8`` (what a decode step reads of the Llama-3.1-8B shape), its
command line, and bench/fp8_logit_error.py end to end on a toy Llama (``--smoke``: the
FP8 products' torch references)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import fp8_logit_error  # noqa: E402
import gpu_bench_models as models  # noqa: E402
import gpu_engine  # noqa: E402


def test_fp8_decode_bytes_of_the_llama_8b_shape():
    config = models.hf_config("llama-3.1-8b")
    bf16, fp8 = models.model_facts(config), models.model_facts(config, "fp8")
    # per layer: fused QKV 6144 + o 4096 + gate-up 28672 rows of 4096, down 4096 of 14336
    weights = 32 * (6144 * 4096 + 4096 * 4096 + 28672 * 4096 + 4096 * 14336)
    scales = 32 * 4 * (6144 + 4096 + 28672 + 4096)
    assert bf16["decode_weight_bytes"] - fp8["decode_weight_bytes"] == weights - scales
    head = 128256 * 4096 * 2  # the LM head stays bf16; the embedding is not read
    assert fp8["decode_weight_bytes"] == weights + scales + head + 2 * 4096 * (2 * 32 + 1)
    assert fp8["param_bytes"] == bf16["param_bytes"]  # the bf16 checkpoint written
    assert (bf16["quantization"], fp8["quantization"]) == ("none", "fp8")
    with_head = models.model_facts(config, "fp8-lm-head")
    assert fp8["decode_weight_bytes"] - with_head["decode_weight_bytes"] == head // 2 - 4 * 128256
    with pytest.raises(ValueError, match="no byte accounting for quantization 'int4'"):
        models.model_facts(config, "int4")
    assert gpu_engine.quantization_options("fp8-lm-head") == {
        "quantization": "fp8", "quantization.options": {"quantize_lm_head": True}}
    assert gpu_engine.quantization_options("fp8", {"gemv_num_warps": 8}) == {
        "quantization": "fp8", "quantization.options": {"gemv_num_warps": 8}}
    assert gpu_engine.quantization_options("fp8-lm-head", {"gemv_block_k": 1024}) == {
        "quantization": "fp8",
        "quantization.options": {"quantize_lm_head": True, "gemv_block_k": 1024}}
    assert gpu_engine.quantization_options("none") == {"quantization": "none"}
    from lmkit.frontend.llm_options import build_config

    cfg = build_config("/m", None, gpu_engine.quantization_options("fp8-lm-head"))
    assert (cfg.quantization.backend, cfg.quantization.options) == (
        "fp8", {"quantize_lm_head": True})


def test_command_line_takes_the_quantizations(capsys):
    with pytest.raises(SystemExit):
        gpu_engine.main(["--quantization", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    assert gpu_engine.QUANTIZATIONS == ("none", "fp8", "fp8-lm-head")


def test_logit_error_smoke(tmp_path):
    out = tmp_path / "fp8.json"
    assert fp8_logit_error.main(["--smoke", "--layers", "2", "--sequences", "2", "--length",
                                 "40", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for key in ("prefill_w8a8", "decode_weight_only", "bf16_vs_fp32_floor"):
        assert 0 < report[key]["mean_relative_error"] < 0.1, report[key]
    assert report["prefill_w8a8"]["positions"] == 80
    assert report["decode_weight_only"]["positions"] == 40


def test_one_row_sweep_times_each_launch_plain_and_pipelined():
    import gemv_bandwidth as bw

    assert bw.row_config_key((8, 1024, 4), False) == "8,1024,4"
    assert bw.row_config_key((8, 1024, 4), True) == "8,1024,4,pipelined"
    launches = {"8,1024,4": 1e-5, "8,1024,4,pipelined": 2e-5, "16,512,4": 3e-5}
    rows = [{"M": 1, "name": f"llama8b.{p}", "row_configs": dict(launches)}
            for p in ("qkv", "o", "gate_up", "down")]
    rows[0]["row_configs"].pop("16,512,4")  # not timed for every projection: no sum
    rows += [{"M": 1, "name": "llama8b.lm_head", "row_configs": {"8,1024,4": 1.0}},
             {"M": 16, "name": "llama8b.qkv"}]
    assert bw.layer_sums(rows) == pytest.approx({"8,1024,4": 4e-5,
                                                 "8,1024,4,pipelined": 8e-5})
    assert bw.layer_sums(rows[1:]) == {}  # a projection missing


def test_gemv_fold_bench_takes_fp8_at_one_row_only(monkeypatch, capsys):
    import gemv_fold

    monkeypatch.setattr(sys, "argv", ["gemv_fold.py", "--fp8", "--rows", "1,4"])
    with pytest.raises(SystemExit):
        gemv_fold.main()
    assert ("--fp8 times the one-row FP8 kernel: use --rows 1 without --sweep (got --rows "
            "1,4)") in capsys.readouterr().err
