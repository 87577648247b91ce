"""``lmkit plugin new``: every kind's package installs with pip and passes its own
tests (lmkit's conformance suite for the kind) right after generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lmkit.cli.main import build_app
from lmkit.scaffold.kinds import SCAFFOLD_KINDS
from lmkit.version import PLUGIN_API_VERSION
from typer.testing import CliRunner

pytestmark = pytest.mark.slow  # generates, pip-installs and tests six packages (about 10 s)

NO_AUTOLOAD = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}


def package(kind: str) -> str:
    """The package the fixture generates for ``kind`` (``new-structured-output``)."""
    return "new-" + kind.replace("_", "-")


def lmkit(*args: str):
    return CliRunner().invoke(build_app(env=NO_AUTOLOAD), list(args), env=NO_AUTOLOAD)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One package per kind, written by the CLI."""
    out = tmp_path_factory.mktemp("scaffold")
    for kind in SCAFFOLD_KINDS:
        result = lmkit("plugin", "new", package(kind), "--kind", kind, "--dir", str(out))
        assert result.exit_code == 0, result.output
        assert f"created {kind} plugin '{package(kind)}'" in result.output
    return out


@pytest.fixture(scope="module")
def installed(generated: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The six packages installed by pip into one folder."""
    target = tmp_path_factory.mktemp("scaffold-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--target", str(target),
         *sorted(str(p) for p in generated.iterdir())],
        check=True, capture_output=True, text=True)
    return target


def env_with(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LMKIT_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])]),
               PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    return env


def test_layout_and_entry_point(generated: Path) -> None:
    root = generated / "new-attention"
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == ["README.md", "new_attention/__init__.py", "new_attention/backend.py",
                     "new_attention/plugin.py", "pyproject.toml", "tests/test_new_attention.py"]
    pyproject = (root / "pyproject.toml").read_text()
    assert '[project.entry-points.lmkit]\nnew-attention = "new_attention.plugin"' in pyproject
    assert f'LMKIT_PLUGIN_API = ">={PLUGIN_API_VERSION},<2"' in (
        root / "new_attention/plugin.py").read_text()


def test_every_kind_installs_and_passes_its_tests(generated: Path, installed: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--rootdir",
         str(generated), *sorted(str(p / "tests") for p in generated.iterdir())],
        cwd=generated, env=env_with(installed), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary
    # every kind's conformance class ran (and passed)
    for kind in SCAFFOLD_KINDS:
        name = package(kind)
        assert f"PASSED {name}/tests/test_{name.replace('-', '_')}.py::TestNew" in result.stdout, kind


def test_installed_packages_are_listed_with_versions(installed: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "lmkit.cli.main", "plugins", "list", "--json"],
                            env=env_with(installed), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    for kind in SCAFFOLD_KINDS:
        info = plugins[package(kind)]
        assert (info["status"], info["dist"], info["version"]) == ("loaded", package(kind),
                                                                  "0.1.0")


def test_refuses_bad_names_kinds_and_existing_folders(generated: Path) -> None:
    result = lmkit("plugin", "new", "new-scheduler", "--kind", "scheduler", "--dir",
                   str(generated))
    assert result.exit_code == 2 and "already exists" in result.output
    result = lmkit("plugin", "new", "Bad_Name", "--kind", "scheduler", "--dir", str(generated))
    assert result.exit_code == 2 and "lowercase letters, digits and single dashes" in result.output
    result = lmkit("plugin", "new", "fcfs", "--kind", "scheduler", "--dir", str(generated))
    assert result.exit_code == 2
    assert "scheduler 'fcfs' is already registered by plugin lmkit.schedulers" in result.output
    result = lmkit("plugin", "new", "fine", "--kind", "sampler", "--dir", str(generated))
    assert result.exit_code == 2 and "choose one of: attention, scheduler" in result.output
