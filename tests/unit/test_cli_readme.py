"""The README's commands stay true: its set-up block is what .ci/run runs, and every
``lmkit`` line of its command-line tour parses (and runs, where no model is needed)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from lmkit.cli.main import build_app
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)
NEEDS_A_MODEL = {"generate", "serve", "chat", "bench"}


def tour_commands() -> list[list[str]]:
    lines = [line for lang, block in BLOCKS if lang == "bash" for line in block.splitlines()]
    commands = []
    for line in lines:
        words = shlex.split(line.split("#", 1)[0].split(">", 1)[0])
        if words[:1] == ["lmkit"]:
            commands.append(words[1:])
    return commands


def test_readme_starts_with_the_two_setup_commands() -> None:
    lang, first = BLOCKS[0]
    assert README.index("```") < README.index("\n## ")  # before any section
    serve, tests = first.strip().splitlines()
    assert serve == 'pip install torch==2.13.0 && pip install -e ".[serve,gguf]" && lmkit serve'
    assert tests == ('pip install torch==2.13.0 && pip install -e ".[test]" && '
                     'pytest -q -n 2 --dist loadfile')


def test_ci_runs_the_readme_test_command() -> None:
    script = ROOT / ".ci" / "run"
    extract = re.search(r"test_command=\$\((.*)\)\n", script.read_text()).group(1)  # type: ignore[union-attr]
    found = subprocess.run(["bash", "-c", extract], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    assert found == BLOCKS[0][1].strip().splitlines()[1]


@pytest.mark.parametrize("args", tour_commands(), ids=" ".join)
def test_tour_commands_work(args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                            ) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lmkit.yaml").write_text("scheduler:\n  max_num_seqs: 8\n")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")  # the README's example configs
    for name in [n for n in os.environ if n.upper().startswith("LMKIT_")]:
        monkeypatch.delenv(name)
    env = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if args[0] in NEEDS_A_MODEL:
        args = [*args, "--help"]  # the options parse; running would load a model
    result = CliRunner().invoke(build_app(env=env), args, env=env)
    assert result.exit_code == 0, result.output
