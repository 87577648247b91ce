"""``lmkit config show | check | schema``."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from lmkit.cli.options import ConfigOptions, build_config, build_host, config_options
from lmkit.cli.plugins_cmd import JsonFlag, PluginFlag
from lmkit.cli.render import print_json, print_table, print_text
from lmkit.config.json_schema import config_json_schema
from lmkit.config.sources import flatten
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import configure_and_resolve


def register(app: typer.Typer) -> None:
    """Add the ``config`` command group to ``app``."""
    group = typer.Typer(help="Show, check and describe the configuration.", no_args_is_help=True)
    group.command("show")(show)
    group.command("check")(check)
    group.command("schema")(schema)
    app.add_typer(group, name="config")


@config_options
def show(opts: ConfigOptions, as_json: JsonFlag = False) -> None:
    """Show the effective configuration and which layer (default, file, env, cli) set
    each value."""
    config, provenance = build_config(opts)
    values = flatten(config.model_dump(mode="json"))
    if as_json:
        print_json({"config": config.model_dump(mode="json"), "sources": provenance})
        return
    rows = []
    for path, value in values.items():
        layer = provenance.get(path, "default")
        where = config.source_of(path) if layer != "default" else None
        rows.append((path, json.dumps(value), layer, where or ""))
    print_table("Effective configuration", ("setting", "value", "layer", "set by"), rows)


@config_options
def check(opts: ConfigOptions, as_json: JsonFlag = False) -> None:
    """Resolve and cross-check the whole stack for this configuration without loading
    a model. Exits 2 with the reasons when it does not fit together."""
    config, _ = build_config(opts)
    host = build_host(config)
    stack = configure_and_resolve(config, host)  # plugins' own checks too, as at engine start
    if as_json:
        print_json(stack.as_dict())
        return
    rows = []
    for kind, reg in stack.entries.items():
        options = stack.options.get(kind)
        shown = json.dumps(options.model_dump(mode="json")) if options is not None else ""
        rows.append((kind, reg.name if reg else "none", reg.origin if reg else "-",
                     shown if shown != "{}" else ""))
    print_table(f"Stack (device {stack.device}, dtype {stack.dtype})",
                ("kind", "implementation", "plugin", "options"), rows)
    for info in host.failures():
        print_text(f"warning: plugin {info.name} failed to load: {info.error}", style="yellow")
    print_text("configuration OK", style="green")


def schema(
    plugin: PluginFlag = None,
    indent: Annotated[int, typer.Option(help="JSON indentation.")] = 2,
) -> None:
    """Print the JSON Schema of the configuration, including the options schema of every
    installed implementation (for editors and validators)."""
    host = PluginHost.load(plugins=plugin or ())
    typer.echo(json.dumps(config_json_schema(host), indent=indent))
