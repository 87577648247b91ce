"""Loading the configuration: file formats, environment variables, CLI settings,
precedence (CLI > env > file > defaults), provenance, and error messages."""

from __future__ import annotations

from pathlib import Path

import pytest
from lmkit.config import LMKitConfig, load_config
from lmkit.config.sources import parse_text_value
from lmkit.errors import ConfigError


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_when_nothing_is_given() -> None:
    config, provenance = load_config(None, {}, {})
    assert config == LMKitConfig()
    assert set(provenance.values()) == {"default"}
    assert provenance["scheduler.max_num_seqs"] == "default"
    assert config.source_of("scheduler.max_num_seqs") is None


def test_precedence_is_cli_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    file = write(tmp_path / "c.yaml", """
scheduler:
  max_num_seqs: 4
  max_num_batched_tokens: 512
  enable_chunked_prefill: false
cache:
  block_size: 32
""")
    env = {"LMKIT_SCHEDULER__MAX_NUM_SEQS": "8", "LMKIT_SCHEDULER__MAX_NUM_BATCHED_TOKENS": "1024"}
    config, provenance = load_config(file, {"scheduler.max_num_seqs": 16}, env)
    assert config.scheduler.max_num_seqs == 16
    assert config.scheduler.max_num_batched_tokens == 1024
    assert config.scheduler.enable_chunked_prefill is False
    assert config.cache.block_size == 32
    assert config.model.seed == 0
    assert {k: provenance[k] for k in (
        "scheduler.max_num_seqs", "scheduler.max_num_batched_tokens",
        "scheduler.enable_chunked_prefill", "cache.block_size", "model.seed")} == {
        "scheduler.max_num_seqs": "cli", "scheduler.max_num_batched_tokens": "env",
        "scheduler.enable_chunked_prefill": "file", "cache.block_size": "file",
        "model.seed": "default"}
    assert config.source_of("cache.block_size") == f"config file '{file}', line 7"
    assert config.source_of("scheduler.max_num_batched_tokens") == (
        "environment variable LMKIT_SCHEDULER__MAX_NUM_BATCHED_TOKENS")


def test_options_mappings_merge_across_layers(tmp_path: Path) -> None:
    file = write(tmp_path / "c.yaml", "attention:\n  backend: x\n  options: {a: 1, b: 2}\n")
    config, provenance = load_config(
        file, {"attention.options.c": 3}, {"LMKIT_ATTENTION__OPTIONS": '{"b": 20}'})
    assert config.attention.options == {"a": 1, "b": 20, "c": 3}
    assert [provenance[f"attention.options.{k}"] for k in "abc"] == ["file", "env", "cli"]


def test_toml_files_with_line_numbers(tmp_path: Path) -> None:
    file = write(tmp_path / "c.toml", """
[model]
model = "tiny"

[scheduler]
max_num_seqs = 0
""")
    config, _ = load_config(file, {}, {"LMKIT_SCHEDULER__MAX_NUM_SEQS": "3"})
    assert (config.model.model, config.scheduler.max_num_seqs) == ("tiny", 3)
    with pytest.raises(ConfigError) as exc:
        load_config(file, {}, {})
    assert str(exc.value) == (
        "invalid configuration:\n  scheduler.max_num_seqs: Input should be greater than 0 "
        f"(got 0) [set by config file '{file}', line 6]")


def test_environment_values_are_read_as_yaml_except_for_text_fields() -> None:
    env = {
        "LMKIT_EXECUTOR__ENFORCE_EAGER": "true",
        "LMKIT_CACHE__KV_CACHE_MEMORY_GB": "1.5",
        "LMKIT_MODEL__MAX_MODEL_LEN": "null",
        "LMKIT_SERVER__CORS_ORIGINS": '["http://a", "http://b"]',
        "LMKIT_ATTENTION__OPTIONS__WINDOW": "128",
        "LMKIT_MODEL__MODEL": "0123",  # a text field keeps its leading zero
        "lmkit_model__seed": "7",  # names are case-insensitive
        "LMKIT_API_KEY": "007",
        # these mean other things and are not settings
        "LMKIT_PLUGINS": "x", "LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1", "LMKIT_CACHE": "/tmp/c",
        "OTHER__VAR": "1",
    }
    config, provenance = load_config(None, {}, env)
    assert config.executor.enforce_eager is True
    assert config.cache.kv_cache_memory_gb == 1.5
    assert config.model.max_model_len is None
    assert config.server.cors_origins == ["http://a", "http://b"]
    assert config.attention.options == {"window": 128}
    assert (config.model.model, config.model.seed, config.server.api_key) == ("0123", 7, "007")
    assert config.plugins == []
    assert provenance["server.api_key"] == "env"


def test_the_explicit_variable_wins_over_the_api_key_alias() -> None:
    config, _ = load_config(None, {}, {"LMKIT_API_KEY": "a", "LMKIT_SERVER__API_KEY": "b"})
    assert config.server.api_key == "b"


def test_text_values_parse_like_yaml_1_2() -> None:
    assert parse_text_value("executor.enforce_eager", "false") is False
    assert parse_text_value("attention.options.mode", "on") == "on"  # not a YAML 1.1 boolean
    assert parse_text_value("attention.options.k", "{a: [1, 2]}") == {"a": [1, 2]}
    assert parse_text_value("model.model", "true") == "true"
    assert parse_text_value("attention.options.x", "[unclosed") == "[unclosed"


def test_plugins_add_up_across_layers(tmp_path: Path) -> None:
    file = write(tmp_path / "c.yaml", "plugins: [from-file]\n")
    config, provenance = load_config(file, {"plugins": ["no:other", "from-cli"]}, {})
    assert config.plugins == ["from-file", "no:other", "from-cli"]
    assert provenance["plugins"] == "cli"


def test_a_typo_in_a_section_field_suggests_the_field(tmp_path: Path) -> None:
    file = write(tmp_path / "c.yaml", "scheduler:\n  max_num_seq: 8\n")
    with pytest.raises(ConfigError) as exc:
        load_config(file, {}, {})
    assert str(exc.value) == (
        "invalid configuration:\n  scheduler.max_num_seq: unknown field; did you mean "
        f"'scheduler.max_num_seqs'? [set by config file '{file}', line 2]")


def test_a_typo_in_a_section_name_suggests_the_section() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, {}, {"LMKIT_SCHEDULR__MAX_NUM_SEQS": "8"})
    assert str(exc.value) == (
        "invalid configuration:\n  schedulr: unknown field; did you mean 'scheduler'? "
        "[set by environment variable LMKIT_SCHEDULR__MAX_NUM_SEQS]")


def test_a_bad_type_gives_path_value_expectation_and_flag() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, {"scheduler.max_num_seqs": "many"}, {},
                    cli_flags={"scheduler.max_num_seqs": "--max-num-seqs"})
    assert str(exc.value) == (
        "invalid configuration:\n  scheduler.max_num_seqs: Input should be a valid integer, "
        "unable to parse string as an integer (got 'many') [set by command-line option "
        "--max-num-seqs]")


def test_a_misspelled_choice_suggests_the_closest_one() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, {"executor.device": "cdua"}, {})
    assert str(exc.value) == (
        "invalid configuration:\n  executor.device: Input should be 'auto', 'cpu' or 'cuda' "
        "(got 'cdua'); did you mean 'cuda'? [set by explicit setting executor.device]")


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    file = write(tmp_path / "c.yaml", "cache:\n  block_size: 12\nserver:\n  port: 70000\n")
    with pytest.raises(ConfigError) as exc:
        load_config(file, {}, {})
    lines = str(exc.value).splitlines()
    assert lines[1] == (f"  cache.block_size: must be a power of two, such as 16 or 32 "
                        f"(got 12) [set by config file '{file}', line 2]")
    assert lines[2].startswith("  server.port: Input should be less than or equal to 65535")


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("missing.yaml", None, "config file '{path}' does not exist."),
    ("c.ini", "", "config file '{path}' has an unknown extension '.ini'; use .yaml, .yml or .toml."),
    ("c.yaml", "model:\n  model: [unclosed\n", "config file '{path}' is not valid YAML at line 3, "
                                               "column 1: expected ',' or ']', but got '<stream end>'."),
    ("c.toml", "[model\n", "config file '{path}' is not valid TOML: "),
    ("c.yaml", "- a\n- b\n", "config file '{path}' must hold a mapping of sections (model:, "
                             "scheduler:, ...), not a list."),
])
def test_unusable_files_are_clear_errors(tmp_path: Path, name: str, text: str | None,
                                         expected: str) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path, {}, {})
    assert str(exc.value).startswith(expected.format(path=path))


def test_an_empty_file_is_an_empty_layer(tmp_path: Path) -> None:
    config, _ = load_config(write(tmp_path / "c.yml", "# nothing yet\n"), {}, {})
    assert config == LMKitConfig()


def test_a_malformed_variable_name_is_an_error() -> None:
    with pytest.raises(ConfigError, match="LMKIT_SCHEDULER____X is not a valid setting name"):
        load_config(None, {}, {"LMKIT_SCHEDULER____X": "1"})
