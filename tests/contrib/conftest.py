"""The contrib packages, installed for real: ``pip install --no-deps
--no-build-isolation --target DIR`` from copies of ``contrib/<package>`` (so the source
tree gets no build/ or egg-info), once per test session. Tests put DIR on ``sys.path``
(in-process) or ``PYTHONPATH`` (subprocesses); the dist-info there carries each
package's ``lmkit`` entry point and version."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

CONTRIB = Path(__file__).resolve().parents[2] / "contrib"
PACKAGES = ("lmkit-fair-scheduler", "lmkit-llguidance")

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture(scope="session")
def contrib_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder where pip installed every contrib package (their dependencies, lmkit
    and llguidance, come from the test environment)."""
    if importlib.util.find_spec("llguidance") is None:
        pytest.skip("llguidance is not installed (pip install llguidance)")
    src = tmp_path_factory.mktemp("contrib-src")
    target = tmp_path_factory.mktemp("contrib-site")
    copies = [shutil.copytree(CONTRIB / name, src / name,
                              ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
              for name in PACKAGES]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--target", str(target), *map(str, copies)],
        check=True, capture_output=True, text=True)
    return target


@pytest.fixture
def contrib_on_path(contrib_site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The installed contrib packages, importable (and their entry points visible) in
    this process for one test."""
    monkeypatch.syspath_prepend(str(contrib_site))
    for name in ("lmkit_fair_scheduler", "lmkit_llguidance"):
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, mod)
    return contrib_site


@pytest.fixture
def subprocess_env(contrib_site: Path) -> dict[str, str]:
    """The environment of a subprocess that sees the installed contrib packages."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LMKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(contrib_site),
                                         *filter(None, [os.environ.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@pytest.fixture
def lmkit(subprocess_env: dict[str, str]) -> Runner:
    """Run the real ``lmkit ARGS`` command with the contrib packages installed."""

    def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "lmkit.cli.main", *args],
                              env=subprocess_env, cwd=cwd, capture_output=True, text=True,
                              timeout=120)

    return run
