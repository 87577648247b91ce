"""Bad input at the edges other than HTTP (configuration, the CLI, the Python API) gets a
specific error naming the value and what is expected, and a refused request leaves the
engine usable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lmkit import LLM, SamplingParams
from lmkit.cli.main import build_app
from lmkit.config import LMKitConfig, load_config
from lmkit.errors import ConfigError, InvalidRequestError, PluginLoadError
from lmkit.frontend.processor import child_params
from lmkit.testing.tiny_model import make_tiny_model
from typer.testing import CliRunner, Result

ENV = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
INT64_MAX = 2**63 - 1


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("LMKIT_"):
            monkeypatch.delenv(name)


def run(*args: str) -> Result:
    return CliRunner().invoke(build_app(env=ENV), list(args), env=ENV)


def assert_cli_error(result: Result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ")
    assert "Traceback" not in result.output
    for word in words:
        assert word in result.stderr


# ------------------------------------------------------------------ SamplingParams


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"temperature": "0.5"}, ["temperature must be a number", "'0.5' (str)"]),
    ({"top_p": None}, ["top_p must be a number", "None"]),
    ({"min_tokens": 1.5}, ["min_tokens must be an integer", "1.5 (float)"]),
    ({"seed": "3"}, ["seed must be an integer or None", "'3' (str)"]),
    ({"seed": 1.5}, ["seed must be an integer or None"]),
    ({"logprobs": 1.5}, ["logprobs must be an integer or None"]),
    ({"logprobs": True}, ["logprobs must be an integer or None", "True (bool)"]),
    ({"max_tokens": True}, ["max_tokens must be an integer or None", "True (bool)"]),
    ({"n": True}, ["n must be an integer", "True (bool)"]),
    ({"ignore_eos": "no"}, ["ignore_eos must be true or false", "'no' (str)"]),
    ({"stop": 123}, ["stop must be a string or a list of strings", "123 (int)"]),
    ({"stop": [1]}, ["stop must be a list of strings", "[1]"]),
    ({"stop": ["a", None]}, ["stop must be a list of strings"]),
    ({"stop_token_ids": "12"}, ["stop_token_ids must be a list of token ids", "'12' (str)"]),
    ({"stop_token_ids": [1.7]}, ["stop_token_ids must be a list of integer token ids"]),
    ({"stop_token_ids": ["a"]}, ["stop_token_ids must be a list of integer token ids"]),
    ({"logit_bias": [1, 2]}, ["logit_bias must be a mapping of token id to bias"]),
    ({"logit_bias": {"a": 1}}, ["logit_bias keys must be integer token ids", "'a' (str)"]),
    ({"logit_bias": {1.5: 1}}, ["logit_bias keys must be integer token ids", "1.5 (float)"]),
    ({"logit_bias": {1: "x"}}, ["logit_bias values must be numbers in [-100, 100]", "'x'"]),
    ({"allowed_token_ids": 5}, ["allowed_token_ids must be a list of token ids", "5 (int)"]),
    ({"bad_words": 5}, ["bad_words must be a list of strings"]),
    ({"bad_words_token_ids": [1, 2]}, ["bad_words_token_ids must be non-empty lists"]),
    ({"logits_processors": 5}, ["logits_processors must be a list of names"]),
])
def test_sampling_params_of_the_wrong_type_are_refused_by_name(kwargs, words):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == next(iter(kwargs))
    for word in words:
        assert word in str(info.value)


def test_sampling_params_keep_accepting_what_they_accepted():
    import numpy as np

    params = SamplingParams(temperature=1, top_k=np.int64(5), stop="x", stop_token_ids=(3,),
                            logit_bias={"7": 2}, seed=np.int32(4), bad_words="w")
    assert (params.temperature, params.top_k, params.stop, params.stop_token_ids) == (
        1.0, 5, ["x"], [3])
    assert (params.logit_bias, params.seed, params.bad_words) == ({7: 2.0}, 4, ["w"])
    assert type(params.top_k) is int and type(params.seed) is int


def test_children_of_a_seed_at_the_top_of_64_bits_stay_valid():
    params = SamplingParams(n=3, seed=INT64_MAX)
    seeds = [child_params(params, i).seed for i in range(3)]
    assert seeds == [INT64_MAX, -(2**63), -(2**63) + 1]
    assert child_params(SamplingParams(n=2, seed=5), 1).seed == 6


# ------------------------------------------------------------------ configuration


def test_numbers_are_finite_and_never_booleans(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"cache.kv_cache_memory_gb: Input should be a "
                                          r"finite number \(got inf\)"):
        load_config(None, {"cache.kv_cache_memory_gb": float("inf")}, {})
    file = tmp_path / "c.yaml"
    file.write_text("cache:\n  block_size: true\n")
    with pytest.raises(ConfigError, match=r"cache.block_size: must be a number, not "
                                          r"true/false \(got True\)"):
        load_config(file, {}, {})


def test_sizes_and_addresses_are_bounded():
    """A max_num_seqs that would allocate per-request state for 10**12 requests (was a
    bare MemoryError at start) and an empty bind address are refused by the config."""
    with pytest.raises(ConfigError, match=r"scheduler.max_num_seqs: Input should be less "
                                          r"than or equal to 65536 \(got 1000000000000\)"):
        load_config(None, {"scheduler.max_num_seqs": 10**12}, {})
    with pytest.raises(ConfigError, match=r"server.host: String should have at least 1 "
                                          r"character"):
        load_config(None, {"server.host": ""}, {})
    assert load_config(None, {"scheduler.max_num_seqs": 65536}, {})[0].scheduler.max_num_seqs \
        == 65536


def test_a_key_given_twice_in_a_yaml_file_is_an_error(tmp_path: Path):
    file = tmp_path / "c.yaml"
    file.write_text("scheduler:\n  max_num_seqs: 4\nmodel:\n  model: a\n"
                    "scheduler:\n  max_num_seqs: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(file, {}, {})
    assert str(info.value) == (f"config file '{file}' sets 'scheduler' twice (lines 1 and 5); "
                               "keep one.")


def test_a_directory_as_config_file_says_so(tmp_path: Path):
    (tmp_path / "conf.yaml").mkdir()
    for path in (tmp_path, tmp_path / "conf.yaml"):
        with pytest.raises(ConfigError, match=f"config file '{path}' is a directory"):
            load_config(path, {}, {})


@pytest.mark.parametrize("key", ["", ".a", "scheduler.", "scheduler..max_num_seqs"])
def test_a_setting_name_with_an_empty_part_is_refused(key: str):
    with pytest.raises(ConfigError, match="is not a setting name; use a dotted path"):
        load_config(None, {key: 1}, {})


@pytest.mark.parametrize(("settings", "message"), [
    ({"plugins": ["no:"]}, "plugins: 'no:' is not a plugin name"),
    ({"plugins": [""]}, "plugins: '' is not a plugin name"),
    ({"model.seed": 2**64}, "model.seed: Input should be less than or equal to "
                            f"{INT64_MAX}"),
])
def test_config_values_that_would_fail_later_are_refused(settings, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, settings, {})
    assert message in str(info.value)


# ------------------------------------------------------------------ CLI


@pytest.mark.parametrize(("args", "words"), [
    (("config", "check", "--set", ".a=5"), ["--set .a=5: '.a' is not a setting name"]),
    (("config", "check", "-c", ""), ["is a directory; give a .yaml, .yml or .toml file"]),
    (("config", "check", "-p", "no:"), ["'no:' is not a plugin name",
                                        "[set by command-line option --plugin]"]),
    (("serve", "--port", "70000", "missing-model"),
     ["invalid server option:", "server.port: Input should be less than or equal to 65535 "
      "(got 70000) [set by command-line option --port]"]),
    (("serve", "--log-level", "loud", "missing-model"),
     ["--log-level 'loud' is not a log level; use one of: critical"]),
    (("serve", "--shutdown-timeout", "nan", "missing-model"),
     ["--shutdown-timeout must be a finite number of seconds >= 0, got nan"]),
    (("bench", "throughput", "--workload", "nope"), ["--workload 'nope' is unknown"]),
    (("bench", "throughput", "--workload", "file"), ["--workload file needs --dataset"]),
    (("bench", "latency", "--num-prompts", "0"), ["--num-prompts must be at least 1, got 0"]),
    (("bench", "latency", "--peer", "vllm"), ["--peer 'vllm' is unknown; use one of: hf"]),
])
def test_cli_user_errors_are_one_line_before_any_model_loads(args, words):
    assert_cli_error(run(*args), *words)


def test_cli_files_of_the_wrong_kind_are_user_errors(tmp_path: Path):
    binary = tmp_path / "schema.json"
    binary.write_bytes(b"\xff\xfe")
    assert_cli_error(run("generate", "hi", "--json-schema", str(binary)),
                     f"--json-schema {binary}: cannot read a JSON schema")
    text = tmp_path / "text.json"
    text.write_text('"a string"')
    assert_cli_error(run("generate", "hi", "--json-schema", str(text)),
                     f"--json-schema {text}: a JSON schema is an object", "not a str")
    assert_cli_error(run("bench", "latency", "--out", str(tmp_path)),
                     f"--out {tmp_path}: give a file path in an existing folder")
    assert_cli_error(run("plugin", "new", "good", "--kind", "attention", "--dir", str(binary)),
                     f"--dir {binary} is not a directory")
    missing = tmp_path / "file" / "below"
    (tmp_path / "file").write_text("")
    assert_cli_error(run("plugin", "new", "good", "--kind", "attention", "--dir", str(missing)),
                     f"cannot write the plugin package into --dir {missing}")


# ------------------------------------------------------------------ LLM


def test_llm_config_object_with_bad_keywords_is_a_config_error():
    cfg = LMKitConfig()
    with pytest.raises(ConfigError, match="nosuch: unknown field"):
        LLM(config=cfg, **{"nosuch.x": 1})
    with pytest.raises(ConfigError, match=r"scheduler.max_num_seqs: Input should be a valid "
                                          r"integer.*\(got 'abc'\)"):
        LLM(config=cfg, max_num_seqs="abc")
    with pytest.raises(TypeError, match="LLM\\(config=...\\) takes an LMKitConfig or the path"):
        LLM(config={"scheduler": {"max_num_seqs": 2}})  # type: ignore[arg-type]


def test_llm_plugins_given_as_one_string_is_one_plugin():
    with pytest.raises(PluginLoadError) as info:
        LLM(plugins="lmkit_no_such_plugin")  # type: ignore[arg-type]
    assert "plugin 'lmkit_no_such_plugin' not found" in str(info.value)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny")
    engine = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, num_blocks=32,
                 block_size=4)
    yield engine
    engine.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize(("call", "error", "words"), [
    (lambda m: m.generate(["a"], {"temperature": 0}), TypeError,
     ["sampling_params must be a SamplingParams or a list of them", "got dict"]),
    (lambda m: m.generate(["a"], "greedy"), TypeError, ["got str ('greedy')"]),
    (lambda m: m.generate(["a"], [None]), TypeError,
     ["sampling_params[0] is a NoneType (None), not a SamplingParams"]),
    (lambda m: m.generate(["a", "b"], [GREEDY]), ValueError,
     ["got 2 prompts but 1 sampling params"]),
    (lambda m: m.generate(["a", "b"], GREEDY, priority=[1]), ValueError,
     ["got 2 prompts but 1 priorities"]),
    (lambda m: m.generate(["a"], GREEDY, priority=3), TypeError,
     ["priority must be a list of ints, one per prompt, got int (3)"]),
    (lambda m: m.generate(["a"], GREEDY, priority=["x"]), TypeError,
     ["got 'x' (str)"]),
    (lambda m: list(m.stream("a", {"max_tokens": 2})), TypeError,
     ["sampling_params must be a SamplingParams"]),
    (lambda m: m.chat(None), TypeError, ["LLM.chat() takes a conversation"]),
])
def test_bad_generate_arguments_name_what_was_given(llm, call, error, words):
    expected = llm.generate("abcabc", GREEDY)[0].outputs[0].token_ids
    with pytest.raises(error) as info:
        call(llm)
    for word in words:
        assert word in str(info.value)
    assert llm.generate("abcabc", GREEDY)[0].outputs[0].token_ids == expected


def test_n_completions_from_the_largest_seed_run(llm):
    out = llm.generate("abc", SamplingParams(n=3, seed=INT64_MAX, max_tokens=2))[0]
    assert [len(c.token_ids) for c in out.outputs] == [2, 2, 2]
