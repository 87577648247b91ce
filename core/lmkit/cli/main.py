"""The ``lmkit`` command: the root typer app, its built-in sub-commands and plugin commands.

Sub-command modules are listed in :data:`COMMAND_MODULES`; each exposes
``register(app)``. After them, every loaded plugin's ``register_commands(app)`` hook
runs. Nothing here imports torch: ``lmkit --help`` must stay fast.

Errors: an :class:`~lmkit.errors.LMKitError` reaching the CLI edge is printed as one
paragraph (no traceback) and the process exits with the error's ``exit_code`` (2 for
what the user asked for, 1 for a failure while running). Any other exception keeps its
traceback: it is a bug.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import typer

from lmkit.cli.help_style import LMKitSubGroup, apply_help_style
from lmkit.cli.render import print_error, print_json, print_text
from lmkit.errors import LMKitError
from lmkit.plugin_host.manager import PluginHost
from lmkit.version import PLUGIN_API_VERSION, __version__

COMMAND_MODULES: tuple[str, ...] = (
    "lmkit.cli.plugins_cmd",
    "lmkit.cli.config_cmd",
    "lmkit.cli.serve",
    "lmkit.cli.generate",
    "lmkit.cli.chat",
    "lmkit.cli.bench",
    "lmkit.cli.plugin_new",
)

HELP = (
    "lmkit: LLM inference whose every part is a plugin.\n\n"
    "Configuration comes from a file (--config), LMKIT_<SECTION>__<FIELD> environment "
    "variables and flags, in increasing precedence; `lmkit config show` shows the result."
)


class LMKitGroup(LMKitSubGroup):
    """The root command group: turns :class:`LMKitError` into a short message and an exit
    code, for every sub-command including plugins' ones."""

    def invoke(self, ctx: Any) -> Any:  # a click Context (typer vendors its own click)
        try:
            return super().invoke(ctx)
        except LMKitError as e:
            print_error(e)
            raise typer.Exit(e.exit_code) from None


def _show_version(value: bool) -> None:
    if value:
        print_text(f"lmkit {__version__} (plugin API {PLUGIN_API_VERSION})")
        raise typer.Exit()


def _root(
    version: Annotated[
        bool, typer.Option("--version", help="Show the version and exit.",
                           callback=_show_version, is_eager=True)
    ] = False,
) -> None:
    pass  # the app's help text is HELP; this callback only adds --version


def version(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show the lmkit version and the plugin API version it provides."""
    if as_json:
        print_json({"lmkit": __version__, "plugin_api": PLUGIN_API_VERSION})
    else:
        print_text(f"lmkit {__version__}")
        print_text(f"plugin API {PLUGIN_API_VERSION}")


def build_app(plugins: Sequence[str] = (), env: Mapping[str, str] | None = None) -> typer.Typer:
    """The root app with built-in commands and the commands of the plugins that load for
    ``plugins`` (``-p`` values) and ``env``.

    :raises PluginLoadError: a plugin named in ``plugins`` or ``LMKIT_PLUGINS`` failed.
    """
    app = typer.Typer(
        name="lmkit", cls=LMKitGroup, help=HELP, no_args_is_help=True, add_completion=False,
        pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(_root)
    app.command("version")(version)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(app)
    PluginHost.load(plugins=plugins, env=env).add_commands(app)
    apply_help_style(app)
    return app


def plugin_flags(argv: Sequence[str]) -> list[str]:
    """The ``-p``/``--plugin`` values in ``argv``, so that plugins named on the command
    line can add commands before the command line is parsed."""
    found: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--":
            break
        if arg in ("-p", "--plugin"):
            found.append(next(args, ""))
        elif arg.startswith("--plugin="):
            found.append(arg.split("=", 1)[1])
        elif arg.startswith("-p") and not arg.startswith("--"):
            found.append(arg[2:])
    return [f for f in found if f]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``lmkit`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        app = build_app(plugin_flags(args))
    except LMKitError as e:
        print_error(e)
        sys.exit(e.exit_code)
    app(args=args, prog_name="lmkit")


if __name__ == "__main__":
    main()
