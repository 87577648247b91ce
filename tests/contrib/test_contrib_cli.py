"""The contrib packages through the real CLI: listed with their distribution versions,
selected by a config file, their option typos caught, and their own test suites
(lmkit's conformance suites included) passing against the installed packages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import CONTRIB


def test_plugins_list_shows_both_with_versions(lmkit) -> None:
    result = lmkit("plugins", "list", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    plugins = {p["name"]: p for p in report["plugins"]}
    assert (plugins["fair-share"]["dist"], plugins["fair-share"]["version"],
            plugins["fair-share"]["status"]) == ("lmkit-fair-scheduler", "0.1.0", "loaded")
    assert (plugins["llguidance"]["dist"], plugins["llguidance"]["version"],
            plugins["llguidance"]["status"]) == ("lmkit-llguidance", "0.1.0", "loaded")
    specs = {(kind, s["name"]): s for kind, rows in report["specs"].items() for s in rows}
    assert specs[("scheduler", "fair-share")]["available"]
    assert specs[("structured_output", "llguidance")]["available"]
    table = lmkit("plugins", "list").stdout
    assert "lmkit-fair-scheduler 0.1.0" in table and "lmkit-llguidance 0.1.0" in table


def test_a_config_file_selects_them(lmkit, tmp_path: Path) -> None:
    config = tmp_path / "lmkit.yaml"
    config.write_text(
        "scheduler:\n  backend: fair-share\n  options:\n    tenant_from: priority\n"
        "    weights: {'0': 2.0}\n"
        "structured_output:\n  backend: llguidance\n  options:\n    whitespace_flexible: true\n")
    result = lmkit("config", "check", "--config", str(config), "--json")
    assert result.returncode == 0, result.stderr
    stack = json.loads(result.stdout)["stack"]
    assert stack["scheduler"]["name"] == "fair-share"
    assert stack["scheduler"]["dist"] == "lmkit-fair-scheduler"
    assert stack["scheduler"]["options"]["weights"] == {"0": 2.0}
    assert stack["structured_output"]["name"] == "llguidance"
    assert stack["structured_output"]["options"] == {"whitespace_flexible": True}


def test_an_option_typo_in_the_file_is_reported(lmkit, tmp_path: Path) -> None:
    config = tmp_path / "lmkit.yaml"
    config.write_text("scheduler:\n  backend: fair-share\n  options:\n    tenant_frm: priority\n")
    result = lmkit("config", "check", "--config", str(config))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "scheduler.options.tenant_frm" in result.stderr
    assert "tenant_from" in result.stderr


def test_the_packages_own_tests_pass_installed(subprocess_env) -> None:
    """Each package's tests (lmkit's conformance suites and its own checks) against the
    pip-installed package, in one pytest process."""
    tests = [str(CONTRIB / name / "tests") for name in ("lmkit-fair-scheduler", "lmkit-llguidance")]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(CONTRIB), *tests], env=subprocess_env, capture_output=True, text=True, timeout=300,
        cwd=CONTRIB)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
