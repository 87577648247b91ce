"""bench/gpu_engine.py's DeepSeek side on the CPU: the random DeepSeek-V2-Lite-shape
checkpoint (per-expert names, as real checkpoints and lmkit's loader have them, while
transformers 5 stacks the experts in memory) loads into transformers with every weight
from the file, the MoE/MLA byte accounting, the command line, and (slow) workloads W4
and W5 end to end with ``--smoke`` against transformers' ``generate``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import gpu_bench_models as models  # noqa: E402
import gpu_engine  # noqa: E402
import gpu_workloads  # noqa: E402


def test_v2_lite_config_is_the_real_shape_and_layers_can_be_cut():
    full = models.hf_config("deepseek-v2-lite")
    assert (full.num_hidden_layers, full.hidden_size, full.kv_lora_rank,
            full.n_routed_experts, full.num_experts_per_tok) == (27, 2048, 512, 64, 6)
    assert models.hf_config("deepseek-v2-lite", 4).num_hidden_layers == 4
    with pytest.raises(ValueError, match="num_layers must be at least 1"):
        models.hf_config("deepseek-v2-lite", 0)
    facts = models.model_facts(full)
    assert 15.5e9 < facts["num_params"] < 16e9  # DeepSeek-V2-Lite: 15.7B
    assert facts["kv_bytes_per_token"] == 27 * 576 * 2  # the MLA latent, bf16
    moe = facts["moe"]
    assert moe == {"layers": 26, "experts": 64, "top_k": 6, "expert_bytes": 3 * 1408 * 2048 * 2}
    every_expert = 26 * 64 * moe["expert_bytes"]
    assert facts["decode_weight_bytes"] == facts["param_bytes"] - every_expert - (
        102400 * 2048 * 2)  # untied: the embedding table is not read by a decode step
    # batch 1 touches top_k experts per layer; a large batch nearly all of them
    assert models.expected_expert_bytes(moe, 1) == pytest.approx(26 * 6 * moe["expert_bytes"])
    assert models.expected_expert_bytes(moe, 256) == pytest.approx(every_expert, rel=1e-6)


def test_written_checkpoint_loads_into_transformers_with_every_weight(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = models.write_model("tiny-deepseek-v2", tmp_path / "m", num_layers=2)
    stamp = json.loads((path / "lmkit-bench-model.json").read_text())
    assert stamp == {"name": "tiny-deepseek-v2", "seed": 0, "num_hidden_layers": 2}
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in index
    hf, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    output_loading_info=True)
    assert hf.config.num_hidden_layers == 2
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with safe_open(str(path / index["model.layers.1.mlp.experts.3.down_proj.weight"]),
                   "pt") as f:
        down = f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight")
    assert torch.equal(hf.model.layers[1].mlp.experts.down_proj[3], down.float())


def test_command_line_refuses_unknown_workloads_and_bad_layers(capsys):
    with pytest.raises(SystemExit):
        gpu_engine.main(["--workloads", "W4,W9"])
    assert "unknown workload W9; choose from W1, W2, W3, W4, W5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_engine.main(["--workloads", "W4", "--layers", "0"])
    assert "--layers must be at least 1" in capsys.readouterr().err
    wls = gpu_workloads.make_workloads(smoke=False)
    assert len(wls["W4"]["prompts"]) == 256 and {len(p) for p in wls["W4"]["prompts"]} == {512}
    assert wls["W4"]["output_lens"] == [256] * 256
    assert len(wls["W5"]["prompts"]) == 1 and wls["W5"]["output_lens"] == [256]


@pytest.mark.slow
def test_smoke_runs_w4_w5_on_lmkit_and_transformers(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "gpu_engine.py"), "--smoke", "--workloads", "W4,W5",
         "--attention", "mla_torch", "--peer", "hf", "--layers", "2", "--hf-subset", "W4=4",
         "--hf-batch", "2", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["lmkit"]["deepseek-v2-lite"]["stack"]["attention"] == "mla_torch"
    assert report["models"]["deepseek-v2-lite"]["num_hidden_layers"] == 2
    assert report["hf"]["deepseek-v2-lite"]["mode"] == "generate, static batches of 2"
    rows = {r["workload"]: r for r in report["rows"]}
    assert rows["W4"]["lmkit_output_tokens"] == 6 * 8 and rows["W4"]["hf_requests"] == 4
    assert rows["W4"]["ratio_tok_s"] > 0 and rows["W5"]["hf_tpot_ms"] > 0
    assert rows["W5"]["lmkit_tpot_ms"] > 0
    assert "deepseek-v2-lite: 2 of its 3 layers" in proc.stdout
