"""One name per extension point: the kind in ``plugins list``, the config section, the
``LLM(...)`` keyword, the CLI flag and the scaffold kind agree; old spellings work only
as deprecated aliases; ``--help`` shows no ``<bool>`` for flags and no ``{name}``."""

from __future__ import annotations

import json
import warnings

import pytest
from lmkit.cli.main import build_app
from lmkit.cli.options import FLAGS
from lmkit.config.schema import LMKitConfig
from lmkit.frontend.llm_options import SHORT_OPTIONS, build_config
from lmkit.plugin_host.kinds import KINDS, REGISTER_HOOKS, STACK_KINDS
from lmkit.plugin_host.manager import PluginHost
from lmkit.scaffold.kinds import SCAFFOLD_KINDS
from typer.testing import CliRunner

ENV = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}


def run(*args: str):
    return CliRunner().invoke(build_app(env=ENV), list(args), env=ENV)


@pytest.mark.parametrize("kind", STACK_KINDS)
def test_each_stack_kind_has_one_name_everywhere(kind: str) -> None:
    assert kind in KINDS and kind in REGISTER_HOOKS  # plugins list, registry
    assert kind in LMKitConfig.model_fields  # config section
    assert SHORT_OPTIONS[kind] == f"{kind}.backend"  # LLM(speculative=...)
    flags = {f.decls[0]: f.path for f in FLAGS}
    assert flags[f"--{kind.replace('_', '-')}"] == f"{kind}.backend"  # --speculative
    assert kind in SCAFFOLD_KINDS  # lmkit plugin new --kind speculative


def test_cli_flags_and_llm_keywords_share_names() -> None:
    """Every flag that sets one setting is an LLM(...) keyword of the same name
    (``--no-prefix-caching`` is the negation of ``enable_prefix_caching``; ``model`` is
    LLM's first argument)."""
    for flag in FLAGS:
        if flag.path is None or flag.name in ("model", "plugin", "no_prefix_caching"):
            continue
        assert SHORT_OPTIONS.get(flag.name) == flag.path, flag.decls[0]


def test_plugins_list_shows_the_kind_names() -> None:
    data = json.loads(run("plugins", "list", "--json").stdout)
    assert set(data["specs"]) == set(KINDS)
    assert "ngram" in {s["name"] for s in data["specs"]["speculative"]}
    tables = run("plugins", "list").stdout.splitlines()  # each kind's table under its name
    assert "speculative" in tables and "spec_proposer" not in tables


def test_old_kind_name_is_a_deprecated_alias() -> None:
    registry = PluginHost.load(env=ENV).registry
    with pytest.warns(DeprecationWarning, match="'spec_proposer' is now called 'speculative'"):
        assert registry.get("spec_proposer", "ngram").kind == "speculative"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.names("speculative") == ["ngram", "eagle", "eagle3"]
    result = run("plugins", "show", "ngram", "--kind", "spec_proposer")
    assert result.exit_code == 0 and "use --kind speculative instead" in result.stderr
    result = run("plugins", "show", "ngram", "--kind", "speculativ")
    assert result.exit_code == 2 and "Did you mean 'speculative'?" in result.stderr


def test_llm_keyword_named_like_an_old_flag_gets_a_hint() -> None:
    with pytest.raises(TypeError, match=r"Did you mean 'speculative' \(the CLI's --speculative\)"):
        build_config(None, None, {"spec": "ngram"})
    with pytest.raises(TypeError, match=r"Did you mean 'attention'"):
        build_config(None, None, {"attn": "torch"})
    cfg = build_config(None, None, {"speculative": "ngram", "structured_output": "none"})
    assert (cfg.speculative.backend, cfg.structured_output.backend) == ("ngram", "none")


def test_a_plugin_option_given_a_mapping_says_where_its_settings_go() -> None:
    # vLLM's speculative_config style: the plugin's name is a string, its settings have
    # their own options (or dotted paths)
    with pytest.raises(TypeError, match=r"LLM\(speculative=...\) takes the speculative "
                       r"plugin's name \(a string\), got a dict with keys 'method', 'model'\. "
                       r"Pass the name as speculative='NAME', the section's other settings "
                       r"with num_speculative_tokens=\.\.\., speculative_adaptive=\.\.\., "
                       r"speculative_model=\.\.\., speculative_tree=\.\.\., or any setting"):
        build_config(None, None, {"speculative": {"method": "eagle3", "model": "HEAD"}})
    with pytest.raises(TypeError, match=r"LLM\(attention=...\) takes the attention plugin's "
                       r"name .* e\.g\. \*\*\{'attention\.options': \{\.\.\.\}\}"):
        build_config(None, None, {"attention": {"backend": "triton"}})
    cfg = build_config(None, None, {"speculative": "eagle3", "speculative_model": "HEAD",
                                    "num_speculative_tokens": 2})
    assert (cfg.speculative.backend, cfg.speculative.model,
            cfg.speculative.num_speculative_tokens) == ("eagle3", "HEAD", 2)


def test_old_scaffold_kinds_are_deprecated_aliases(tmp_path) -> None:
    result = run("plugin", "new", "my-drafts", "--kind", "proposer", "--dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "use --kind speculative instead" in result.stderr
    assert "created speculative plugin 'my-drafts'" in result.stdout
    readme = (tmp_path / "my-drafts" / "README.md").read_text()
    assert "speculative:\n  backend: my-drafts" in readme
    result = run("plugin", "new", "my-choices", "--kind", "grammar", "--dir", str(tmp_path))
    assert result.exit_code == 0 and "use --kind structured_output instead" in result.stderr


@pytest.mark.parametrize("command", [("plugin", "new"), ("generate",), ("config", "check"),
                                     ("plugins",), ()])
def test_help_shows_no_bool_type_and_no_braces(command: tuple[str, ...]) -> None:
    text = run(*command, "--help").stdout
    assert "--help" in text
    assert "<bool>" not in text and "{" not in text, text


def test_help_usage_names_arguments_in_capitals() -> None:
    usage = run("plugin", "new", "--help").stdout
    assert "Usage: lmkit plugin new [OPTIONS] NAME" in usage
    assert "Usage: lmkit plugins show [OPTIONS] NAME" in run("plugins", "show", "--help").stdout
