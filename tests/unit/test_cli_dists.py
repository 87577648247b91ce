"""The real ``lmkit`` command in a subprocess, with the test distributions installed
(see test_plugin_dists.py): what a user sees, exit codes, and no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from lmkit.platform import cuda_device_count
from test_plugin_dists import install_test_dists

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture(scope="module")
def installed_dists(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_test_dists(tmp_path_factory)


@pytest.fixture
def lmkit(installed_dists: Path) -> Runner:
    """Run ``lmkit ARGS`` with the test distributions on PYTHONPATH."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("LMKIT_")}
    base["PYTHONPATH"] = os.pathsep.join(
        [str(installed_dists), *filter(None, [os.environ.get("PYTHONPATH")])])

    def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "lmkit.cli.main", *args],
                              env={**base, **(env or {})}, cwd=cwd, capture_output=True,
                              text=True, timeout=60)

    return run


def test_plugins_list_shows_failures_and_unavailable_specs_without_traceback(lmkit) -> None:
    result = lmkit("plugins", "list")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Traceback" not in out + result.stderr
    for line in ("good-test", "lmkit-testplugin-good 1.2.3"):
        assert line in out
    assert "broken-test: failed: RuntimeError: lmkit-testplugin-broken cannot start" in out
    assert "dup-test: failed: scheduler 'fcfs' is registered twice" in out
    assert "oldapi-test: failed: plugin oldapi-test (lmkit-testplugin-oldapi 0.9.0) supports" in out
    assert "typo-test: failed: plugin 'typo-test' implements unknown hook(s)" in out
    gpu_row = next(line for line in out.splitlines() if "gpu-only-test" in line)
    assert "missing module 'not_installed_mod'" in gpu_row
    if cuda_device_count() == 0:
        assert "no CUDA device" in gpu_row
    data = json.loads(lmkit("plugins", "list", "--json").stdout)
    status = {p["name"]: p["status"] for p in data["plugins"]}
    assert status["good-test"] == "loaded" and status["broken-test"] == "failed"


def test_a_broken_plugin_named_with_p_is_fatal(lmkit) -> None:
    result = lmkit("-p", "broken-test", "plugins", "list")
    assert result.returncode == 2
    assert result.stderr == (
        "error: plugin 'broken-test' (lmkit_testplugin_broken.plugin) failed to import: "
        "RuntimeError: lmkit-testplugin-broken cannot start: its backend library is missing\n")
    assert result.stdout == ""


def test_plugin_commands_and_loading_controls(lmkit) -> None:
    result = lmkit("hello-test", "--name", "lmkit")
    assert (result.returncode, result.stdout) == (0, "hello lmkit from lmkit-testplugin-good\n")
    assert lmkit("-p", "no:good-test", "hello-test").returncode == 2  # no such command now
    listed = json.loads(lmkit("plugins", "list", "--json",
                              env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}).stdout)
    assert {p["name"]: p["status"] for p in listed["plugins"]}["good-test"] == "not loaded"
    listed = json.loads(lmkit("plugins", "list", "--json", env={"LMKIT_PLUGINS": "good-test"}).stdout)
    assert {p["name"]: p["status"] for p in listed["plugins"]}["typo-test"] == "not allowed"


def test_config_check_catches_a_cross_kind_incompatibility(lmkit) -> None:
    result = lmkit("config", "check", "--speculative", "needs-feature-test", "--attention", "torch")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: the chosen backends do not work together:")
    assert ("speculative proposer 'needs-feature-test' (plugin good-test) needs attention with "
            "some_feature, but attention 'torch' (plugin lmkit.attention) does not support "
            "some_feature") in result.stderr
    result = lmkit("config", "check", "--speculative", "needs-feature-test")
    assert result.returncode == 2
    assert result.stderr.startswith("error: no attention fits this configuration")
    assert "(Needed because speculative proposer 'needs-feature-test' needs some_feature.)" in result.stderr


def test_config_check_reports_a_typo_in_a_plugin_option_from_yaml(lmkit, tmp_path: Path) -> None:
    file = tmp_path / "lmkit.yaml"
    file.write_text("scheduler:\n  backend: fair-test\n  options:\n    quantum_token: 128\n")
    result = lmkit("config", "check", "-c", str(file))
    assert result.returncode == 2
    assert result.stderr == (
        "error: invalid options for scheduler 'fair-test' (plugin good-test (lmkit-testplugin-good "
        "1.2.3)):\n  scheduler.options.quantum_token: unknown field; did you mean "
        f"'scheduler.options.quantum_tokens'? [set by config file '{file}', line 4]\n")
    file.write_text("scheduler:\n  backend: fair-test\n  options:\n    quantum_tokens: 128\n")
    result = lmkit("config", "check", "-c", str(file), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stack"]["scheduler"]["options"] == {
        "quantum_tokens": 128, "max_share": 0.5}


def test_plugin_options_schemas_are_shown(lmkit) -> None:
    spec = json.loads(lmkit("plugins", "show", "fair-test", "--json").stdout)["specs"][0]
    assert (spec["plugin"], spec["dist"], spec["version"]) == (
        "good-test", "lmkit-testplugin-good", "1.2.3")
    assert set(spec["options_schema"]["properties"]) == {"quantum_tokens", "max_share"}
    schema = json.loads(lmkit("config", "schema").stdout)
    assert "scheduler.fair-test.options" in schema["$defs"]
    assert "fair-test" in schema["$defs"]["SchedulerConfig"]["properties"]["backend"]["enum"]
