"""Every example configuration in examples/ passes ``lmkit config check``. A file that
asks for CUDA is refused on a machine without it, with the reason, and checked there
with the device and dtype overridden for the CPU (everything else as written)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from lmkit.cli.main import build_app
from lmkit.platform import cuda_device_count
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").iterdir() if p.suffix in (".yaml", ".yml"))
ENV = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("LMKIT_"):
            monkeypatch.delenv(name)


def check(*args: str):
    return CliRunner().invoke(build_app(env=ENV), ["config", "check", *args], env=ENV)


def test_examples_exist_and_the_readme_points_at_them() -> None:
    assert {p.name for p in EXAMPLES} >= {"cpu.yaml", "gpu.yaml", "multi-gpu.yaml"}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for path in EXAMPLES:
        assert f"examples/{path.name}" in readme, path.name


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_config_check(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.lstrip().startswith("#")  # says what it is for
    wants_cuda = yaml.safe_load(text).get("executor", {}).get("device") == "cuda"
    result = check("-c", str(path))
    if wants_cuda and cuda_device_count() == 0:
        assert result.exit_code == 2, result.output
        assert "executor.device is 'cuda' (set by config file" in result.stderr
        assert "this machine has no CUDA device" in result.stderr
        result = check("-c", str(path), "--device", "cpu", "--dtype", "float32")
    assert result.exit_code == 0, result.output
    assert "configuration OK" in result.stdout


def test_gpu_example_selects_speculation_and_offload() -> None:
    result = CliRunner().invoke(
        build_app(env=ENV), ["config", "check", "-c", str(ROOT / "examples/gpu.yaml"), "--json",
                             "--device", "cpu", "--dtype", "float32"], env=ENV)
    assert result.exit_code == 0, result.output
    stack = yaml.safe_load(result.stdout)["stack"]  # JSON is YAML
    assert stack["speculative"]["name"] == "ngram" and stack["offload"]["name"] == "cpu+disk"


def test_multi_gpu_example_splits_the_model_over_ranks() -> None:
    result = CliRunner().invoke(
        build_app(env=ENV), ["config", "check", "-c", str(ROOT / "examples/multi-gpu.yaml"),
                             "--json", "--device", "cpu", "--dtype", "float32"], env=ENV)
    assert result.exit_code == 0, result.output
    checked = yaml.safe_load(result.stdout)
    assert checked["stack"]["executor"]["name"] == "mp"
