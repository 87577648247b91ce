"""Every built-in implementation of every stack kind that can run on this machine
passes its conformance suite. Implementations registered later (a proposer, a grammar
backend, an offload tier) are picked up here automatically."""

from __future__ import annotations

from pathlib import Path

import pytest
from lmkit.api.mla_attention import MLA
from lmkit.api.spec_decode import RUNNER_HOSTED_FEATURES
from lmkit.plugin_host.manager import PluginHost
from lmkit.testing.attention import check_attention_backend
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head
from lmkit.testing.executor import check_executor
from lmkit.testing.mla_attention import check_mla_attention_backend
from lmkit.testing.offload import check_offload_manager
from lmkit.testing.quantization import check_quantization_method
from lmkit.testing.runner_proposer import check_runner_proposer
from lmkit.testing.scheduler import check_scheduler
from lmkit.testing.spec_decode import check_spec_proposer
from lmkit.testing.structured_output import check_structured_output_backend

HOST = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
SUITES = {
    "attention": check_attention_backend,
    "scheduler": check_scheduler,
    "executor": check_executor,
    "speculative": check_spec_proposer,
    "structured_output": check_structured_output_backend,
    "offload": check_offload_manager,
    "quantization": check_quantization_method,
}
# runner-hosted proposers (draft heads) are checked with a random head made for the target
HEAD_MAKERS = {"eagle": make_tiny_eagle_head, "eagle3": make_tiny_eagle3_head}
# slow: executors that start worker processes (importing torch), and quantization
# methods, which run on the default model (its GGUF file: a download, ~20 s)
SLOW = {("executor", "mp"), ("executor", "ray")}
BUILTINS = [pytest.param(kind, reg.name, id=f"{kind}-{reg.name}",
                         marks=[pytest.mark.slow]
                         if (kind, reg.name) in SLOW or kind == "quantization" else [])
            for kind in SUITES for reg in HOST.registry.all(kind)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmkit.testing.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-builtins"))


def test_the_sweep_covers_the_builtins_present_today():
    names = {(kind, name) for kind, name in (p.values for p in BUILTINS)}
    assert {("attention", "torch"), ("scheduler", "fcfs"), ("scheduler", "priority"),
            ("executor", "uniproc")} <= names


@pytest.mark.parametrize(("kind", "name"), BUILTINS)
def test_builtin_passes_its_suite(kind: str, name: str, request: pytest.FixtureRequest) -> None:
    reg = HOST.registry.get(kind, name)
    if reg.spec.unavailable_reasons():
        pytest.skip(f"{name} cannot run here: {'; '.join(reg.spec.unavailable_reasons())}")
    if kind == "speculative" and RUNNER_HOSTED_FEATURES & reg.spec.caps.features:
        model_dir = request.getfixturevalue("model_dir")
        assert name in HEAD_MAKERS, f"no test head for the runner-hosted proposer {name!r}"
        head = HEAD_MAKERS[name](model_dir.parent / f"head-{name}", model_dir)
        results = check_runner_proposer(reg, model_dir=model_dir, head_dir=head)
    elif kind in ("executor", "speculative"):
        results = SUITES[kind](reg, model_dir=request.getfixturevalue("model_dir"))
    elif kind == "quantization" and "cpu" not in reg.spec.caps.values.get("device", {"cpu"}):
        # the suite runs on the CPU; fp8 is checked by test_quant_fp8_numerics (the suite
        # on its CPU references) and tests/gpu/test_fp8_gpu.py
        pytest.skip(f"{name} declares no cpu device")
    elif kind == "quantization":
        results = SUITES[kind](reg, model_dir=request.getfixturevalue("smollm2_dir"))
    elif kind == "attention" and MLA in (reg.spec.caps.values.get("attention_kind") or ()):
        results = check_mla_attention_backend(reg)  # latent-cache backends: the MLA suite
    else:
        results = SUITES[kind](reg)
    assert "passed" in results.values()
    assert all(r == "passed" or r.startswith("not applicable") for r in results.values())
