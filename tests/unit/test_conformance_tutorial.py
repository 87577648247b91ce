"""docs/tutorial-attention-backend.md, executed: its files are extracted, installed
with pip, their conformance tests run, and its "run" block generates with the backend."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lmkit.api import Spec
from lmkit.testing import ConformanceFailure
from lmkit.testing.attention import check_attention_backend

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorial-attention-backend.md"
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.S | re.M)


def blocks() -> tuple[dict[str, str], list[str]]:
    """The tutorial's files (``file=PATH`` blocks) and its ``run`` blocks."""
    files, runs = {}, []
    for _lang, info, body in FENCE.findall(TUTORIAL.read_text()):
        match = re.search(r"file=(\S+)", info)
        if match:
            files[match.group(1)] = body
        elif info.strip() == "run":
            runs.append(body)
    return files, runs


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    """(the extracted package, a pip target with it installed, the run blocks)."""
    files, runs = blocks()
    root = tmp_path_factory.mktemp("tutorial")
    for rel, body in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body)
    site = tmp_path_factory.mktemp("tutorial-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "--disable-pip-version-check",
                    "--target", str(site), str(root / "tutorial-attn")],
                   check=True, capture_output=True, text=True)
    return root / "tutorial-attn", site, runs


def env_with(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LMKIT_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])]),
               PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    return env


def test_the_tutorial_has_its_four_files_and_a_run_block():
    files, runs = blocks()
    assert sorted(files) == [
        "tutorial-attn/pyproject.toml", "tutorial-attn/tests/test_tutorial_attn.py",
        "tutorial-attn/tutorial_attn/__init__.py", "tutorial-attn/tutorial_attn/backend.py",
        "tutorial-attn/tutorial_attn/plugin.py"]
    assert len(runs) == 1


def test_the_tutorial_backend_passes_its_conformance_tests(tutorial):
    package, site, _ = tutorial
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(package / "tests")], cwd=package, env=env_with(site),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "12 passed, 7 skipped" in result.stdout  # as the tutorial says


def test_the_run_block_generates_with_the_backend(tutorial):
    _, site, runs = tutorial
    result = subprocess.run([sys.executable, "-c", runs[0]], env=env_with(site),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("tutorial-attn matches torch")


def test_the_broken_mask_the_tutorial_shows_is_caught(tutorial, tmp_path):
    package, _, _ = tutorial
    source = (package / "tutorial_attn" / "backend.py").read_text()
    broken = source.replace("positions[seq_len - (end - start):]", "positions[:end - start]")
    assert broken != source
    path = tmp_path / "broken_backend.py"
    path.write_text(broken)
    spec = importlib.util.spec_from_file_location("broken_tutorial_backend", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = Spec(name="tutorial-attn", target=lambda: module.TutorialAttention)
    with pytest.raises(ConformanceFailure) as exc:
        check_attention_backend(target, only=["decode"])
    assert "'tutorial-attn' fails property 'decode'" in str(exc.value)
    assert "step 2 (decode 1): [req 0: context 3, query 1" in str(exc.value)
