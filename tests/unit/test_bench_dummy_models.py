"""bench/gpu_bench_models.py without weight files (``--load-format dummy``) and the
70B shape of W6/W7."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_bench_models as models  # noqa: E402
from gpu_workloads import WORKLOAD_MODELS, make_workloads  # noqa: E402


def test_a_config_only_model_directory(tmp_path):
    d = models.write_model("tiny-llama", tmp_path / "m", weights=False)
    assert (d / "config.json").is_file() and (d / "tokenizer.json").is_file()
    assert not list(d.glob("*.safetensors"))
    stamp = (d / "lmkit-bench-model.json").read_text()
    assert models.write_model("tiny-llama", d, weights=False) == d  # reused as it is
    assert (d / "lmkit-bench-model.json").read_text() == stamp
    full = models.write_model("tiny-llama", d)  # a different stamp: weights written
    assert list(full.glob("*.safetensors"))


def test_the_70b_shape_and_its_workloads():
    facts = models.model_facts(models.hf_config("llama-3.1-70b"))
    assert 70.5e9 < facts["num_params"] < 70.6e9
    assert WORKLOAD_MODELS["W6"] == WORKLOAD_MODELS["W7"] == "llama-3.1-70b"
    wls = make_workloads(smoke=True)
    assert wls["W6"]["prompts"] == wls["W2"]["prompts"]
    assert wls["W7"]["prompts"] == wls["W3"]["prompts"]
