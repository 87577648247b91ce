"""Edges found by probing a third-party plugin author's mistakes (registration and
loading) and bad structured-output constraints through the real engine on the CPU."""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path
from typing import Any

import pytest
from lmkit import LLM, SamplingParams
from lmkit.api import Caps, Needs, Spec
from lmkit.errors import InvalidRequestError, PluginAPIVersionError, PluginError, PluginLoadError
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.report import host_report
from lmkit.structured.constraint import MAX_NESTING, parse_constraint
from lmkit.testing.tiny_model import make_tiny_model
from pydantic import BaseModel, ConfigDict, Field
from test_plugin_host import isolated_host, plugin, registering, sched

# ------------------------------------------------------------------------------ plugins


def spec_hook(**fields: Any) -> Any:
    """A register hook building ``Spec(**fields)`` when called (as a plugin does)."""

    def hook(register: Any) -> None:
        register(Spec(**{"target": "somewhere:x", **fields}))

    return hook


def test_a_register_hook_returning_its_spec_instead_of_registering_it_fails() -> None:
    def register_schedulers(register: Any) -> Spec:
        return sched("x")

    with pytest.raises(PluginError) as exc:
        isolated_host(("p", plugin(register_schedulers=register_schedulers)))
    assert str(exc.value) == ("plugin 'p': register_schedulers returned Spec, which is ignored; "
                              "call register(spec) once per implementation and return None.")


def test_a_hook_with_the_wrong_parameter_names_shows_the_hooks_signature() -> None:
    with pytest.raises(PluginError) as exc:
        isolated_host(("p", plugin(register_schedulers=lambda reg: None)))
    assert str(exc.value) == (
        "plugin 'p': its register_schedulers(reg) takes 'reg', which the hook does not "
        "provide; the hook is register_schedulers(register) (an implementation takes some or "
        "all of these, by name).")


def test_registering_a_list_says_to_register_each_spec() -> None:
    def hook(register: Any) -> None:
        register([sched("a")])

    with pytest.raises(PluginError, match=r"registered list for scheduler; expected "
                                          r"lmkit.api.Spec \(call register once per spec\)"):
        isolated_host(("p", plugin(register_schedulers=hook)))


@pytest.mark.parametrize(("fields", "message"), [
    ({"name": "x", "priority": "high"}, "Spec 'x': priority must be an int, got 'high'"),
    ({"name": "x", "priority": True}, "Spec 'x': priority must be an int, got True"),
    ({"name": "x", "caps": {"features": ["a"]}}, "Spec 'x': caps must be lmkit.api.Caps"),
    ({"name": "x", "requires": "xgrammar"}, "Spec 'x': requires must be a tuple of non-empty "
                                            "strings, e.g. ('xgrammar',)"),
    ({"name": "x", "aliases": "foo"}, "Spec 'x': aliases must be a tuple of non-empty strings"),
    ({"name": "x", "target": 5}, "Spec 'x': target must be 'module:attr' or a callable, got 5"),
    ({"name": "x", "needs_cuda": "yes"}, "Spec 'x': needs_cuda must be True or False"),
    ({"name": "x", "variants": ["fa4"]}, "Spec 'x': variants must be a tuple of lmkit.api.Variant"),
    ({"name": "x", "stack_needs": {"attention": {"f"}}},
     "Spec 'x': stack_needs['attention'] must be lmkit.api.Needs, got set"),
    ({"name": "x", "stack_needs": {"atention": Needs()}},
     "Spec 'x': stack_needs names unknown kind 'atention'"),
    ({"name": "My Sched"}, "Spec.name must be a non-empty string without spaces, got 'My Sched'"),
])
def test_spec_fields_of_the_wrong_type_fail_at_registration(fields: dict[str, Any],
                                                            message: str) -> None:
    with pytest.raises(PluginError) as exc:
        isolated_host(("p", plugin(register_schedulers=spec_hook(**fields))))
    assert str(exc.value).startswith("plugin 'p' failed in register_schedulers: TypeError: ")
    assert message in str(exc.value)


def test_an_autoloaded_plugin_with_a_bad_spec_fails_alone() -> None:
    """A string priority used to break sorting, so ``lmkit plugins list`` and every
    selection of the kind, for all plugins."""
    host = PluginHost()
    host.register(plugin(register_schedulers=spec_hook(name="bad", priority="high")), "bad",
                  source="entrypoint", fatal=False)
    host.register(plugin(register_schedulers=registering(sched("good"))), "good")
    host.collect()
    assert host.plugins["bad"].status == "failed"
    assert "priority must be an int" in (host.plugins["bad"].error or "")
    assert host.registry.names("scheduler") == ["good"]
    assert host.select("scheduler", "auto").name == "good"
    assert [s["name"] for s in host_report(host)["specs"]["scheduler"]] == ["good"]


class BadDefault(BaseModel):
    model_config = ConfigDict(extra="forbid")
    quantum: int = Field(0, gt=5)


class Required(BaseModel):
    model_config = ConfigDict(extra="forbid")
    endpoint: str
    retries: int = Field(3, ge=0)


def test_an_options_model_that_rejects_its_own_defaults_is_refused() -> None:
    with pytest.raises(TypeError) as exc:
        Spec(name="x", target="a:b", options=BadDefault)
    assert str(exc.value) == (
        "Spec 'x': the options model BadDefault rejects its own defaults (quantum: Input should "
        "be greater than 5); give every option a default that validates")
    # options the user must set (no default) are fine
    assert Spec(name="y", target="a:b", options=Required).options is Required


def test_an_empty_plugin_api_declaration_is_refused() -> None:
    with pytest.raises(PluginAPIVersionError, match="declares an empty LMKIT_PLUGIN_API, which "
                                                    "would claim every plugin API version"):
        isolated_host(("p", plugin(api=" ", register_schedulers=registering(sched("x")))))


def test_a_second_plugin_with_a_taken_name_keeps_the_first_listed() -> None:
    host = isolated_host(builtins=True)
    taken = next(p for p in host.plugins.values() if p.source == "builtin")
    clash = plugin(register_schedulers=registering(sched("zz")))
    host.register(clash, taken.name, source="entrypoint", fatal=False)
    assert host.plugins[taken.name].status == "loaded"  # the built-in's row survives
    failed = host.plugins[f"{taken.name} [{type(clash).__name__}]"]
    assert failed.status == "failed"
    assert f"the plugin name {taken.name!r} is already taken by plugin {taken.origin}" in (
        failed.error or "")
    with pytest.raises(PluginLoadError, match="rename its entry point"):
        host.register(clash, taken.name, source="object")


def test_a_plugin_that_exits_at_import_does_not_exit_the_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lmkit_probe_exits.py").write_text("import sys\nsys.exit('no config found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHost()
    ep = md.EntryPoint("exits", "lmkit_probe_exits", "lmkit")
    host._load_entry_point(ep, "entrypoint", fatal=False)
    assert (host.plugins["exits"].status, host.plugins["exits"].error) == (
        "failed", "SystemExit: no config found")
    sys.modules.pop("lmkit_probe_exits", None)
    with pytest.raises(PluginLoadError, match="'lmkit_probe_exits' failed to import: "
                                              "SystemExit: no config found"):
        PluginHost.load(plugins=["lmkit_probe_exits"], env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})


CANDIDATES = (sched("a", 5), sched("b", 1))


def test_a_failing_decision_hook_is_named() -> None:
    def choose_implementation(kind: str, candidates: Any, needs: Any) -> str:
        raise ZeroDivisionError("oops")

    host = isolated_host(("p", plugin(register_schedulers=registering(*CANDIDATES))),
                         ("chooser", plugin(choose_implementation=choose_implementation)))
    with pytest.raises(PluginError, match="plugin 'chooser' failed in choose_implementation "
                                          "for scheduler: ZeroDivisionError: oops"):
        host.select("scheduler", "auto")


def test_a_decision_hook_must_answer_with_a_name() -> None:
    host = isolated_host(("p", plugin(register_schedulers=registering(*CANDIDATES))),
                         ("chooser", plugin(choose_implementation=lambda kind, candidates, needs:
                                            candidates[1])))
    with pytest.raises(PluginError) as exc:
        host.select("scheduler", "auto")
    assert str(exc.value) == ("plugin 'chooser': choose_implementation returned Registration for "
                              "scheduler; return the chosen candidate's name (one of a, b) or "
                              "None.")


def test_a_wrapping_decision_hook_still_decides() -> None:
    """A ``wrapper=True`` implementation drives the others through pluggy's call: it sees
    their answer and may replace it."""
    import types

    import lmkit

    seen = []

    def chooser(kind: str, candidates: Any, needs: Any) -> str:
        return "a"

    def wrapping(kind: str, candidates: Any, needs: Any):
        answer = yield
        seen.append(answer)
        return "b"

    wrapper = types.SimpleNamespace(LMKIT_PLUGIN_API=">=1.0,<2")
    wrapper.choose_implementation = lmkit.hookimpl(wrapper=True)(wrapping)
    host = isolated_host(("p", plugin(register_schedulers=registering(*CANDIDATES))),
                         ("chooser", plugin(choose_implementation=chooser)),
                         ("wrapper", wrapper))
    assert host.select("scheduler", "auto").name == "b" and seen == ["a"]


def test_caps_still_accept_plain_sets() -> None:
    spec = Spec(name="c", target="a:b", caps=Caps({"x"}, {"device": {"cpu"}}),
                requires=["torch"], aliases=("c2",))
    assert spec.requires == ("torch",) and spec.aliases == ("c2",)


# ------------------------------------------------------------------- structured output


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("spec", [
    {"json": nested_schema(1500)},  # used to raise RecursionError from json.dumps
    {"json": nested_schema(MAX_NESTING + 1)},
    {"json": "[" * 3000 + "]" * 3000},  # used to raise RecursionError from json.loads
    {"structural_tag": "[" * 3000 + "]" * 3000},
])
def test_deeply_nested_constraints_are_invalid_requests(spec: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError, match=f"nested more than {MAX_NESTING} levels deep"):
        parse_constraint(spec)


def test_constraints_must_be_finite_json_data() -> None:
    with pytest.raises(InvalidRequestError, match="contains a number that is not finite"):
        parse_constraint({"json": {"type": "integer", "minimum": float("inf")}})
    with pytest.raises(InvalidRequestError, match="the json constraint is not JSON data: "
                                                  "Object of type set"):
        parse_constraint({"json": {"enum": {"a", "b"}}})
    assert parse_constraint({"json": nested_schema(MAX_NESTING)}).kind == "json"


COMMON = dict(device="cpu", dtype="float32", max_model_len=256, num_blocks=96, block_size=4)
GOOD = SamplingParams(max_tokens=5, temperature=0, structured_outputs={"regex": "[a-c]{3}"})


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    engine = LLM(str(make_tiny_model(tmp_path_factory.mktemp("tiny-probe"))), progress=False,
                 **COMMON)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(("constraint", "message"), [
    ({"json": nested_schema(1500)}, "nested more than 200 levels deep"),
    ({"json": "{\"items\":" * 3000 + "{}" + "}" * 3000}, "nested more than 200 levels deep"),
    ({"json": {"type": "number", "maximum": 1e400}}, "a number that is not finite"),
    # xgrammar ignored required names not declared in properties: {} was accepted
    ({"json": {"type": "object", "required": ["b"]}},
     "does not support the JSON schema keyword 'required' (at #): required property 'b' is "
     "not declared in 'properties' next to it"),
    ({"json": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}},
     "required property 'b' is not declared"),
])
def test_bad_constraints_fail_their_request_and_the_engine_goes_on(
        llm: Any, constraint: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        llm.generate("abc", SamplingParams(max_tokens=8, structured_outputs=constraint))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("abc", GOOD)[0].outputs[0].text == "ccc"
