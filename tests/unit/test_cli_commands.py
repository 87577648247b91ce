"""The ``lmkit`` CLI in-process (typer's CliRunner), with the built-in plugins only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import typer
from lmkit import PLUGIN_API_VERSION, __version__
from lmkit.cli.main import LMKitGroup, build_app, plugin_flags
from lmkit.errors import ConfigError, EngineDeadError
from typer.testing import CliRunner, Result

ENV = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("LMKIT_"):
            monkeypatch.delenv(name)


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    env = {**ENV, **(env or {})}
    return CliRunner().invoke(build_app(env=env), list(args), env=env)


def test_version_and_help() -> None:
    assert run("--version").stdout == f"lmkit {__version__} (plugin API {PLUGIN_API_VERSION})\n"
    result = run("version", "--json")
    assert json.loads(result.stdout) == {"lmkit": __version__, "plugin_api": PLUGIN_API_VERSION}
    help_text = run("--help").stdout
    for command in ("version", "plugins", "config"):
        assert command in help_text


def test_plugins_list_shows_plugins_and_specs() -> None:
    result = run("plugins", "list")
    assert result.exit_code == 0
    assert "lmkit.schedulers" in result.stdout and "fcfs" in result.stdout
    assert "available" in result.stdout
    data = json.loads(run("plugins", "list", "--json").stdout)
    assert data["plugin_api"] == PLUGIN_API_VERSION
    schedulers = {p["name"]: p for p in data["plugins"]}["lmkit.schedulers"]
    assert (schedulers["status"], schedulers["source"], schedulers["dist"]) == (
        "loaded", "builtin", "lmkit")
    fcfs = {s["name"]: s for s in data["specs"]["scheduler"]}["fcfs"]
    assert (fcfs["available"], fcfs["reasons"], fcfs["plugin"]) == (True, [], "lmkit.schedulers")


def test_plugins_show_a_spec_and_a_plugin() -> None:
    data = json.loads(run("plugins", "show", "fcfs", "--json").stdout)
    (spec,) = data["specs"]
    assert (spec["kind"], spec["name"]) == ("scheduler", "fcfs")
    assert spec["options_schema"]["type"] == "object"
    data = json.loads(run("plugins", "show", "lmkit.schedulers", "--json").stdout)
    assert "scheduler fcfs" in data["plugin"]["registers"]
    assert run("plugins", "show", "fcfs").exit_code == 0


def test_plugins_show_an_unknown_name_suggests_one() -> None:
    result = run("plugins", "show", "fcsf")
    assert result.exit_code == 2
    assert "no implementation or plugin is named 'fcsf'" in result.stderr
    assert "Did you mean 'fcfs'?" in result.stderr
    assert "Traceback" not in result.output


def test_every_shared_flag_sets_its_setting() -> None:
    result = run(
        "config", "show", "--json", "--model", "m", "--attention", "a", "--scheduler", "s",
        "--executor", "e", "--device", "cpu", "--dtype", "float32", "--speculative", "sp",
        "--num-speculative-tokens", "3", "--structured-output", "so", "--offload", "o",
        "--max-num-seqs", "2",
        "--max-num-batched-tokens", "64", "--block-size", "32", "--no-prefix-caching",
        "--enforce-eager", "--set", "server.port=9", "--set", "attention.options={k: 1}",
        "-p", "no:x", "--plugin", "no:y",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    expected = {
        "model.model": "m", "attention.backend": "a", "scheduler.backend": "s",
        "executor.backend": "e", "executor.device": "cpu", "model.dtype": "float32",
        "speculative.backend": "sp", "speculative.num_speculative_tokens": 3,
        "structured_output.backend": "so", "offload.backend": "o", "scheduler.max_num_seqs": 2,
        "scheduler.max_num_batched_tokens": 64, "cache.block_size": 32,
        "cache.enable_prefix_caching": False, "executor.enforce_eager": True,
        "server.port": 9, "attention.options.k": 1, "plugins": ["no:x", "no:y"],
    }
    for path, value in expected.items():
        section, _, rest = path.partition(".")
        node = data["config"][section]
        for key in rest.split(".") if rest else []:
            node = node[key]
        assert node == value, path
        assert data["sources"][path] == "cli", path
    assert data["sources"]["model.seed"] == "default"


def test_short_flag_spellings_work_without_warnings() -> None:
    result = run("config", "show", "--json", "--attn", "a", "--spec", "sp", "--spec-tokens", "3",
                 "--spec-model", "/heads/h")
    assert result.exit_code == 0, result.output
    config = json.loads(result.stdout)["config"]
    assert (config["attention"]["backend"], config["speculative"]["backend"],
            config["speculative"]["num_speculative_tokens"],
            config["speculative"]["model"]) == ("a", "sp", 3, "/heads/h")
    assert "warning" not in result.stderr  # the headline command is `--attn ... --spec ...`
    # the long spelling wins over the short one; both are in --help
    both = json.loads(run("config", "show", "--json", "--attention", "new", "--attn", "old")
                      .stdout)
    assert both["config"]["attention"]["backend"] == "new"
    shown = run("config", "show", "--help").stdout
    assert "--attn" in shown and "Short for --attention." in shown
    # messages name the spelling that was typed
    result = run("config", "check", "--attn", "torh")
    assert result.exit_code == 2
    assert "(attention.backend = 'torh' was set by command-line option --attn.)" in result.stderr


def test_config_show_names_the_layer_of_each_value(tmp_path: Path) -> None:
    file = tmp_path / "lmkit.yaml"
    file.write_text("scheduler:\n  max_num_seqs: 4\ncache:\n  block_size: 32\n")
    result = run("config", "show", "-c", str(file), "--max-num-seqs", "8",
                 env={"LMKIT_MODEL__SEED": "5"})
    assert result.exit_code == 0
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:5]]
            for line in result.stdout.splitlines() if line.startswith("│")}
    assert rows["scheduler.max_num_seqs"] == ["8", "cli", "command-line option --max-num-seqs"]
    assert rows["cache.block_size"] == ["32", "file", f"config file '{file}', line 4"]
    assert rows["model.seed"] == ["5", "env", "environment variable LMKIT_MODEL__SEED"]
    assert rows["model.dtype"] == ['"auto"', "default", ""]


def test_config_check_prints_the_stack() -> None:
    result = run("config", "check", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "configuration OK" in result.stdout
    data = json.loads(run("config", "check", "--device", "cpu", "--json").stdout)
    assert (data["device"], data["dtype"]) == ("cpu", "float32")
    assert data["stack"]["scheduler"]["plugin"] == "lmkit.schedulers"


@pytest.mark.parametrize(("args", "message"), [
    (("--attention", "torh"), "unknown attention 'torh'; known: "),
    (("--attention", "torh"),
     "(attention.backend = 'torh' was set by command-line option --attention.)"),
    (("--set", "scheduler.max_num_seqs"), "--set expects KEY=VALUE with a dotted key"),
    (("--max-num-seqs", "0"), "scheduler.max_num_seqs: Input should be greater than 0 (got 0)"),
    (("-c", "missing.yaml"), "config file 'missing.yaml' does not exist."),
    (("-p", "lmkit_no_such_plugin"), "plugin 'lmkit_no_such_plugin' not found"),
])
def test_config_check_errors_exit_2_without_traceback(args: tuple[str, ...], message: str) -> None:
    result = run("config", "check", *args)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ")
    assert message in result.stderr
    assert "Traceback" not in result.output


CHECKER = """
import lmkit
from lmkit.api import ConfigError

LMKIT_PLUGIN_API = ">=1.0,<2"


@lmkit.hookimpl
def configure(config):
    print("configure saw max_num_seqs", config.scheduler.max_num_seqs)
    if config.scheduler.max_num_seqs > 100:
        raise ConfigError("this site runs at most 100 sequences")
"""


def test_config_check_runs_the_configure_hook(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lmkit_site_checker.py").write_text(CHECKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run("config", "check", "--device", "cpu", "-p", "lmkit_site_checker",
                 "--max-num-seqs", "7")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("configure saw max_num_seqs 7\n")
    result = run("config", "check", "--device", "cpu", "-p", "lmkit_site_checker",
                 "--max-num-seqs", "101")
    assert (result.exit_code, result.stderr) == (2, "error: this site runs at most 100 sequences\n")


def test_config_schema_is_json_schema_with_plugin_names() -> None:
    schema = json.loads(run("config", "schema").stdout)
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert "fcfs" in schema["$defs"]["SchedulerConfig"]["properties"]["backend"]["enum"]


def test_errors_at_the_cli_edge_map_to_exit_codes() -> None:
    app = typer.Typer(cls=LMKitGroup)

    @app.command()
    def config_problem() -> None:
        raise ConfigError("bad [value] here")

    @app.command()
    def engine_died() -> None:
        raise EngineDeadError("the engine core stopped")

    @app.command()
    def bug() -> None:
        raise ValueError("a bug")

    runner = CliRunner()
    result = runner.invoke(app, ["config-problem"])
    assert (result.exit_code, result.stderr) == (2, "error: bad [value] here\n")
    result = runner.invoke(app, ["engine-died"])
    assert (result.exit_code, result.stderr) == (1, "error: the engine core stopped\n")
    result = runner.invoke(app, ["bug"])
    assert isinstance(result.exception, ValueError)  # a bug keeps its traceback


def test_plugin_flags_are_found_before_parsing() -> None:
    argv = ["-p", "a", "config", "check", "--plugin", "b", "-pc", "--plugin=d", "--", "-p", "e"]
    assert plugin_flags(argv) == ["a", "b", "c", "d"]
