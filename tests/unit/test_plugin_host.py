"""The plugin host with in-process plugins: registration checks, attribution and
selection (explicit names, ``auto`` by reasons -> decision hook -> priority)."""

from __future__ import annotations

import importlib.metadata as md
import types
from collections.abc import Callable
from typing import Any

import lmkit
import pytest
import typer
from lmkit import PLUGIN_API_VERSION
from lmkit.api import Caps, Needs, Spec
from lmkit.errors import (
    DuplicateSpecError,
    NoBackendError,
    PluginAPIVersionError,
    PluginError,
    UnknownBackendError,
)
from lmkit.plugin_host.manager import PluginHost
from typer.testing import CliRunner

API = ">=1.0,<2"


def plugin(api: str | None = API, **hooks: Callable[..., Any]) -> types.SimpleNamespace:
    """An in-process plugin object: ``hooks`` maps hook names to implementations."""
    obj = types.SimpleNamespace()
    if api is not None:
        obj.LMKIT_PLUGIN_API = api
    for name, fn in hooks.items():
        setattr(obj, name, lmkit.hookimpl(fn))
    return obj


def registering(*specs: Spec) -> Callable[[Any], None]:
    """A ``register_*`` hook implementation that registers ``specs``."""

    def hook(register: Any) -> None:
        for spec in specs:
            register(spec)

    return hook


def isolated_host(*plugins: tuple[str, object], builtins: bool = False) -> PluginHost:
    """A host with only ``plugins`` (and, if asked, the built-ins): no third-party
    discovery, so whatever is installed on the machine does not leak in."""
    blocked = [] if builtins else [
        f"no:{ep.name}" for ep in md.entry_points(group="lmkit") if ep.dist and ep.dist.name == "lmkit"
    ]
    return PluginHost.load(plugins=blocked, env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"},
                           extra=list(plugins))


def sched(name: str, priority: int = 0, **kw: Any) -> Spec:
    return Spec(name=name, target=f"somewhere:{name}", priority=priority, **kw)


# ------------------------------------------------------------------------------ loading


def test_in_process_plugin_specs_are_attributed_to_it() -> None:
    host = isolated_host(("mine", plugin(register_schedulers=registering(sched("a"), sched("b")))))
    assert host.registry.names("scheduler") == ["a", "b"]
    reg = host.registry.get("scheduler", "a")
    assert (reg.plugin, reg.dist, reg.origin) == ("mine", None, "mine")
    assert host.plugins["mine"].source == "object"
    assert host.plugins["mine"].hooks == ["register_schedulers"]


def test_builtins_load_first_from_the_lmkit_distribution() -> None:
    host = isolated_host(builtins=True)
    builtins = [p for p in host.plugins.values() if p.source == "builtin"]
    assert builtins and all(p.dist == "lmkit" and p.status == "loaded" for p in builtins)
    assert host.registry.names("scheduler")  # built-in schedulers are plugins too


def test_duplicate_names_across_plugins_are_rejected_naming_both() -> None:
    one = plugin(register_schedulers=registering(sched("same")))
    two = plugin(register_schedulers=registering(sched("same", priority=5)))
    with pytest.raises(DuplicateSpecError) as exc:
        isolated_host(("one", one), ("two", two))
    assert str(exc.value) == ("scheduler 'same' is registered twice: by plugin one and by plugin "
                              "two. Block one with -p no:NAME.")


def test_registering_the_same_spec_again_is_idempotent() -> None:
    spec = sched("same")
    host = isolated_host(("one", plugin(register_schedulers=registering(spec, spec))))
    assert host.registry.names("scheduler") == ["same"]


API = PLUGIN_API_VERSION  # the messages name the running lmkit's


@pytest.mark.parametrize(("declared", "expected"), [
    (None, "plugin 'p' does not declare the plugin API versions it supports; add "
           f"LMKIT_PLUGIN_API = \">=1.0,<2\" to the plugin module (lmkit's is {API})."),
    ("one", "plugin 'p' declares LMKIT_PLUGIN_API = 'one', which is not a version specifier"),
    (">=2", "plugin 'p' supports lmkit plugin API >=2, but this lmkit (0.1.0) provides "
            f"plugin API {API}."),
])
def test_plugin_api_version_is_checked(declared: str | None, expected: str) -> None:
    with pytest.raises(PluginAPIVersionError) as exc:
        isolated_host(("p", plugin(api=declared, register_schedulers=registering(sched("x")))))
    assert str(exc.value).startswith(expected)


def test_misspelled_hook_is_rejected_with_a_suggestion() -> None:
    with pytest.raises(PluginError) as exc:
        isolated_host(("p", plugin(register_attention_backend=registering())))
    assert str(exc.value) == ("plugin 'p' implements unknown hook(s) register_attention_backend. "
                              "Did you mean 'register_attention_backends'?")


def test_failing_and_invalid_registrations_name_the_plugin() -> None:
    def boom(register: Any) -> None:
        raise KeyError("oops")

    with pytest.raises(PluginError, match="plugin 'p' failed in register_schedulers: KeyError"):
        isolated_host(("p", plugin(register_schedulers=boom)))

    def not_a_spec(register: Any) -> None:
        register({"name": "x"})

    with pytest.raises(PluginError, match="plugin 'p' registered dict for scheduler; expected"):
        isolated_host(("p", plugin(register_schedulers=not_a_spec)))


def test_plugins_add_cli_commands() -> None:
    def register_commands(app: Any) -> None:
        @app.command("ping")
        def ping() -> None:
            print("pong")

    host = isolated_host(("p", plugin(register_commands=register_commands)))
    app = typer.Typer()
    app.command("other")(lambda: None)
    host.add_commands(app)
    result = CliRunner().invoke(app, ["ping"])
    assert (result.exit_code, result.output) == (0, "pong\n")


# ------------------------------------------------------------------------------ selection


def test_unknown_name_lists_known_names_and_suggests_one() -> None:
    host = isolated_host(("p", plugin(register_schedulers=registering(
        sched("fcfs", 100), sched("priority", 50)))))
    with pytest.raises(UnknownBackendError) as exc:
        host.select("scheduler", "fcsf")
    assert str(exc.value) == "unknown scheduler 'fcsf'; known: fcfs, priority. Did you mean 'fcfs'?"
    with pytest.raises(UnknownBackendError, match="known: none"):
        host.select("offload", "cpu")


CANDIDATES = (
    sched("fast", 100, requires=("lmkit_not_installed_xyz",)),
    sched("mid", 50),
    sched("slow", 10),
)


def test_auto_drops_candidates_with_reasons_then_takes_the_highest_priority() -> None:
    host = isolated_host(("p", plugin(register_schedulers=registering(*CANDIDATES))))
    assert host.select("scheduler", "auto").name == "mid"


def test_auto_asks_the_decision_hook_with_the_eligible_candidates_only() -> None:
    seen: list[tuple[str, list[str]]] = []

    def choose_implementation(kind: str, candidates: Any, needs: Any) -> str | None:
        seen.append((kind, [c.name for c in candidates]))
        return "slow" if kind == "scheduler" else None

    host = isolated_host(("p", plugin(register_schedulers=registering(*CANDIDATES))),
                         ("chooser", plugin(choose_implementation=choose_implementation)))
    assert host.select("scheduler", "auto").name == "slow"
    assert seen == [("scheduler", ["mid", "slow"])]
    # an explicit name never asks the hook
    assert host.select("scheduler", "mid").name == "mid" and len(seen) == 1


def test_a_decision_hook_that_abstains_leaves_priority_in_charge() -> None:
    host = isolated_host(("p", plugin(register_schedulers=registering(*CANDIDATES))),
                         ("chooser", plugin(choose_implementation=lambda kind, candidates, needs: None)))
    assert host.select("scheduler", "auto").name == "mid"


def test_a_decision_hook_must_pick_an_eligible_candidate() -> None:
    host = isolated_host(("p", plugin(register_schedulers=registering(*CANDIDATES))),
                         ("chooser", plugin(choose_implementation=lambda kind, candidates, needs: "fast")))
    with pytest.raises(NoBackendError, match="picked scheduler 'fast', which is not among the "
                                             "eligible candidates: mid, slow"):
        host.select("scheduler", "auto")


@pytest.mark.parametrize("order", [("b", "a"), ("a", "b")])
def test_registration_order_never_decides(order: tuple[str, str]) -> None:
    first = plugin(register_schedulers=registering(sched(order[0], 7)))
    second = plugin(register_schedulers=registering(sched(order[1], 7)))
    host = isolated_host(("first", first), ("second", second))
    assert host.select("scheduler", "auto").name == "a"  # equal priority: by name
    hi = plugin(register_schedulers=registering(sched("z", 9)))
    host = isolated_host(("first", first), ("hi", hi)) if order[0] == "a" else isolated_host(
        ("hi", hi), ("first", first))
    assert host.select("scheduler", "auto").name == "z"


def test_nothing_fits_explains_every_candidate_in_a_table() -> None:
    cuda_only = Spec(name="cuda-only", target="x:y", caps=Caps(values={"device": {"cuda"}}))
    needs_mtq = Spec(name="plain", target="x:y", caps=Caps(values={"device": {"cpu", "cuda"}}))
    host = isolated_host(("p", plugin(register_attention_backends=registering(cuda_only, needs_mtq))))
    needs = Needs({"multi_token_query"}, {"device": "cpu"})
    with pytest.raises(NoBackendError) as exc:
        host.select("attention", "auto", needs)
    lines = str(exc.value).splitlines()
    assert lines[0] == "no attention fits this configuration (needs: multi_token_query, device=cpu)."
    assert lines[1].split() == ["name", "plugin", "version", "why", "not"]
    assert lines[3].split(None, 3) == [
        "cuda-only", "p", "-", "does not support multi_token_query; device cpu not supported "
        "(supports: cuda)"]
    assert lines[4].split(None, 3) == ["plain", "p", "-", "does not support multi_token_query"]


def test_an_explicit_name_that_does_not_fit_says_why_and_what_would() -> None:
    host = isolated_host(("p", plugin(register_schedulers=registering(*CANDIDATES))))
    with pytest.raises(NoBackendError) as exc:
        host.select("scheduler", "fast")
    assert str(exc.value) == (
        "scheduler 'fast' (plugin p) cannot be used: missing module 'lmkit_not_installed_xyz'. "
        "Needed: nothing. Available instead: mid, slow.")
