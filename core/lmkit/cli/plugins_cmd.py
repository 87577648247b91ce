"""``lmkit plugins list`` and ``lmkit plugins show NAME``."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from lmkit import PLUGIN_API_VERSION, __version__
from lmkit.cli.render import print_deprecated, print_json, print_table, print_text
from lmkit.errors import UnknownBackendError
from lmkit.plugin_host.kinds import KIND_ALIASES, KINDS
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.registry import suggest
from lmkit.plugin_host.report import host_report, spec_report, variant_line

PluginFlag = Annotated[
    list[str] | None,
    typer.Option("--plugin", "-p", help="Load a plugin by name; 'no:NAME' blocks one. Repeatable."),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]


def register(app: typer.Typer) -> None:
    """Add the ``plugins`` command group to ``app``."""
    group = typer.Typer(help="Inspect installed plugins and what they register.",
                        no_args_is_help=True)
    group.command("list")(list_plugins)
    group.command("show")(show)
    app.add_typer(group, name="plugins")


def list_plugins(plugin: PluginFlag = None, as_json: JsonFlag = False) -> None:
    """List every plugin (source, distribution, status, hooks) and every registered
    implementation by kind, with `available` or the reasons it cannot run here."""
    host = PluginHost.load(plugins=plugin or ())
    report = host_report(host)
    if as_json:
        print_json({"lmkit": __version__, "plugin_api": PLUGIN_API_VERSION, **report})
        return
    rows = [
        (p["name"], p["source"], _dist(p), p["status"], ", ".join(p["hooks"]) or "-")
        for p in report["plugins"]
    ]
    print_table(f"Plugins (lmkit {__version__}, plugin API {PLUGIN_API_VERSION})",
                ("plugin", "source", "distribution", "status", "hooks"), rows)
    for p in report["plugins"]:
        if p["error"]:
            print_text(f"  {p['name']}: {p['status']}: {p['error']}", style="red")
    print_text(f"Implementations (this machine: {report['device']})", style="bold")
    for kind in KINDS:
        specs = report["specs"][kind]
        if not specs:
            continue
        rows = [
            (s["name"], s["plugin"], s["priority"],
             "available" if s["available"] else "; ".join(s["reasons"]), s["description"])
            for s in specs
        ]
        print_table(kind, ("name", "plugin", "priority", "status", "description"), rows)
        for s in specs:
            line = variant_line(s)
            if line:
                print_text(f"  {line}")


def show(
    name: Annotated[str, typer.Argument(help="An implementation or plugin name.")],
    kind: Annotated[str | None, typer.Option("--kind", help=f"One of: {', '.join(KINDS)}.")] = None,
    plugin: PluginFlag = None,
    as_json: JsonFlag = False,
) -> None:
    """Show an implementation (options schema, caps, requires, stack needs, availability)
    or a plugin (status and what it registers)."""
    host = PluginHost.load(plugins=plugin or ())
    if kind in KIND_ALIASES:
        print_deprecated(f"--kind {kind}", f"--kind {KIND_ALIASES[kind]}")
        kind = KIND_ALIASES[kind]
    if kind is not None and kind not in KINDS:
        raise UnknownBackendError(f"unknown plugin kind {kind!r}; known: {', '.join(KINDS)}."
                                  + suggest(kind, KINDS))
    kinds = [kind] if kind else list(KINDS)
    specs = [
        spec_report(reg, with_schema=True)
        for k in kinds for reg in host.registry.all(k)
        if name == reg.name or name in reg.spec.aliases
    ]
    info = host.plugins.get(name)
    if not specs and info is None:
        known = sorted({r.name for k in kinds for r in host.registry.all(k)} | set(host.plugins))
        raise UnknownBackendError(
            f"no implementation or plugin is named {name!r}"
            + (f" (kind {kind})" if kind else "") + "; see `lmkit plugins list`."
            + suggest(name, known)
        )
    result: dict[str, Any] = {"specs": specs}
    if info is not None:
        result["plugin"] = {
            "name": info.name, "source": info.source, "module": info.module, "dist": info.dist,
            "version": info.version, "status": info.status, "error": info.error,
            "detail": info.detail, "api": info.api, "hooks": info.hooks,
            "registers": [f"{r.kind} {r.name}" for k in KINDS for r in host.registry.all(k)
                          if r.plugin == info.name],
        }
    if as_json:
        print_json(result)
        return
    if "plugin" in result:
        _print_mapping(f"plugin {name}", result["plugin"])
    for spec in specs:
        schema = spec.pop("options_schema")
        _print_mapping(f"{spec['kind']} {spec['name']}", spec)
        print_text("options schema:", style="bold")
        print_text(json.dumps(schema, indent=2))


def _dist(p: dict[str, Any]) -> str:
    return f"{p['dist']} {p['version']}" if p["dist"] else "-"


def _print_mapping(title: str, data: dict[str, Any]) -> None:
    rows = [(k, v if isinstance(v, str) else json.dumps(v, default=str))
            for k, v in data.items() if v not in (None, [], {}, "")]
    print_table(title, ("field", "value"), rows)
