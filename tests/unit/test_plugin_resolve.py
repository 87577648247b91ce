"""Whole-stack resolution: cross-kind needs, options validated against the chosen spec,
optional kinds, and errors that say where a bad setting came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lmkit.api import Caps, Needs, Spec
from lmkit.config import LMKitConfig, load_config
from lmkit.errors import ConfigError, NoBackendError, StackConflictError, UnknownBackendError
from lmkit.plugin_host.resolve import resolve_stack
from pydantic import BaseModel, ConfigDict, Field
from test_plugin_host import isolated_host, plugin, registering

CPU = {"device": {"cpu"}, "dtype": {"float32"}}


class WindowOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    window_size: int = Field(64, gt=0)
    use_tiles: bool = False


def core_plugin(*attention: Spec) -> object:
    """A scheduler, an executor and the given attention backends: a complete stack."""
    return plugin(
        register_schedulers=registering(Spec(name="sched", target="x:S")),
        register_executors=registering(Spec(name="exec", target="x:E", caps=Caps(values={"device": {"cpu"}}))),
        register_attention_backends=registering(*attention),
    )


PLAIN = Spec(name="plain", target="x:Plain", priority=100, caps=Caps({"multi_token_query"}, CPU))
FANCY = Spec(name="fancy", target="x:Fancy", priority=1, caps=Caps({"some_feature"}, CPU),
             options=WindowOptions)
NEEDY = Spec(name="needy", target="x:Needy", stack_needs={"attention": Needs({"some_feature"})})
CPU_CONFIG = {"LMKIT_EXECUTOR__DEVICE": "cpu"}


def config(cli: dict[str, Any] | None = None, file: Path | None = None,
           env: dict[str, str] | None = None) -> LMKitConfig:
    return load_config(file, cli or {}, {**CPU_CONFIG, **(env or {})})[0]


def test_default_config_resolves_the_builtin_stack() -> None:
    stack = resolve_stack(config(), isolated_host(builtins=True))
    assert (stack.device, stack.dtype) == ("cpu", "float32")
    assert list(stack.entries) == ["executor", "attention", "scheduler", "speculative",
                                   "structured_output", "offload", "quantization"]
    for kind in ("executor", "attention", "scheduler"):
        assert stack.entries[kind] is not None and stack.options[kind] is not None
    assert stack.entries["speculative"] is None  # speculative decoding is off by default
    assert stack.entries["quantization"] is None  # auto follows a checkpoint: none at hand
    assert stack.names()["scheduler"] == stack.entries["scheduler"].name  # type: ignore[union-attr]


def test_needs_imposed_by_a_proposer_steer_auto_over_priority() -> None:
    host = isolated_host(("core", core_plugin(PLAIN, FANCY)),
                         ("spec", plugin(register_spec_proposers=registering(NEEDY))))
    assert resolve_stack(config(), host).entries["attention"].name == "plain"  # type: ignore[union-attr]
    stack = resolve_stack(config({"speculative.backend": "needy"}), host)
    assert stack.entries["attention"].name == "fancy"  # type: ignore[union-attr]
    assert stack.entries["speculative"].name == "needy"  # type: ignore[union-attr]


def test_an_explicit_choice_lacking_an_imposed_need_is_a_stack_conflict() -> None:
    host = isolated_host(("core", core_plugin(PLAIN, FANCY)),
                         ("spec", plugin(register_spec_proposers=registering(NEEDY))))
    with pytest.raises(StackConflictError) as exc:
        resolve_stack(config({"speculative.backend": "needy", "attention.backend": "plain"}), host)
    assert str(exc.value) == (
        "the chosen backends do not work together:\n"
        "  - speculative proposer 'needy' (plugin spec) needs attention with some_feature, but attention "
        "'plain' (plugin core) does not support some_feature\n"
        "Choose compatible backends, or leave one on 'auto'.")


def test_auto_with_nothing_meeting_an_imposed_need_says_who_needs_it() -> None:
    host = isolated_host(("core", core_plugin(PLAIN)),
                         ("spec", plugin(register_spec_proposers=registering(NEEDY))))
    with pytest.raises(NoBackendError) as exc:
        resolve_stack(config({"speculative.backend": "needy"}), host)
    message = str(exc.value)
    assert message.startswith("no attention fits this configuration (needs: some_feature, "
                              "device=cpu, dtype=float32).")
    assert "plain  core    -        does not support some_feature" in message
    assert message.endswith("(Needed because speculative proposer 'needy' needs some_feature.)")


def test_options_are_validated_against_the_chosen_spec(tmp_path: Path) -> None:
    host = isolated_host(("core", core_plugin(PLAIN, FANCY)))
    stack = resolve_stack(config({"attention.backend": "fancy", "attention.options.window_size": 8}),
                          host)
    assert stack.options["attention"] == WindowOptions(window_size=8)
    file = tmp_path / "lmkit.yaml"
    file.write_text("attention:\n  backend: fancy\n  options:\n    window_sise: 128\n")
    with pytest.raises(ConfigError) as exc:
        resolve_stack(config(file=file), host)
    assert str(exc.value) == (
        "invalid options for attention 'fancy' (plugin core):\n"
        "  attention.options.window_sise: unknown field; did you mean "
        f"'attention.options.window_size'? [set by config file '{file}', line 4]")
    with pytest.raises(ConfigError, match=r"attention.options.window_size: Input should be greater "
                                          r"than 0 \(got -1\) \[set by environment variable "
                                          r"LMKIT_ATTENTION__OPTIONS__WINDOW_SIZE\]"):
        resolve_stack(config({"attention.backend": "fancy"},
                             env={"LMKIT_ATTENTION__OPTIONS__WINDOW_SIZE": "-1"}), host)


def test_a_spec_without_an_options_model_takes_no_options() -> None:
    host = isolated_host(("core", core_plugin(PLAIN)))
    with pytest.raises(ConfigError, match="scheduler.options.quantum: unknown field"):
        resolve_stack(config({"scheduler.options": {"quantum": 3}}), host)


def test_an_unknown_backend_name_says_where_it_was_set() -> None:
    host = isolated_host(("core", core_plugin(PLAIN, FANCY)))
    with pytest.raises(UnknownBackendError) as exc:
        resolve_stack(config(env={"LMKIT_ATTENTION__BACKEND": "fanci"}), host)
    assert str(exc.value) == (
        "unknown attention 'fanci'; known: plain, fancy. Did you mean 'fancy'?\n"
        "(attention.backend = 'fanci' was set by environment variable LMKIT_ATTENTION__BACKEND.)")


def test_optional_kinds_under_auto_are_off_when_nothing_fits() -> None:
    unavailable = Spec(name="xg", target="x:G", requires=("lmkit_not_installed_xyz",))
    host = isolated_host(("core", core_plugin(PLAIN)),
                         ("so", plugin(register_structured_output_backends=registering(unavailable))))
    stack = resolve_stack(config({"structured_output.backend": "auto"}), host)
    assert stack.entries["structured_output"] is None
    with pytest.raises(NoBackendError, match="missing module 'lmkit_not_installed_xyz'"):
        resolve_stack(config({"structured_output.backend": "xg"}), host)


def test_a_required_kind_with_no_registration_is_an_error() -> None:
    host = isolated_host(("att", plugin(register_attention_backends=registering(PLAIN))))
    with pytest.raises(NoBackendError, match="no scheduler is registered by any plugin; install or load"):
        resolve_stack(config(), host)


def test_resolved_stack_describes_itself_as_json() -> None:
    host = isolated_host(("core", core_plugin(PLAIN, FANCY)))
    data = resolve_stack(config({"attention.backend": "fancy"}), host).as_dict()
    assert data["device"] == "cpu"
    assert data["stack"]["attention"] == {
        "name": "fancy", "plugin": "core", "dist": None, "version": None,
        "options": {"window_size": 64, "use_tiles": False}}
    assert data["stack"]["offload"] is None
