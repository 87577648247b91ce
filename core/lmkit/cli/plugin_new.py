"""``lmkit plugin new NAME --kind KIND``: start a plugin package that passes lmkit's
conformance suite as generated."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lmkit.cli.render import print_deprecated, print_text
from lmkit.errors import ConfigError
from lmkit.scaffold.kinds import SCAFFOLD_ALIASES, SCAFFOLD_KINDS


def register(app: typer.Typer) -> None:
    """Add the ``plugin`` command group (``lmkit plugin new``) to ``app``."""
    group = typer.Typer(help="Write new plugins (see `lmkit plugins` to inspect installed "
                             "ones).", no_args_is_help=True)
    group.command("new")(new)
    app.add_typer(group, name="plugin")


def new(
    name: Annotated[str, typer.Argument(help="Package and plugin name, e.g. 'my-attention'.")],
    kind: Annotated[str, typer.Option("--kind", "-k",
                                      help=f"One of: {', '.join(SCAFFOLD_KINDS)} (as in "
                                           "`lmkit plugins list`).")],
    directory: Annotated[Path, typer.Option("--dir", help="Where to create the package "
                                            "folder.")] = Path("."),
) -> None:
    """Write a plugin package that installs and passes lmkit's conformance suite.

    NAME/ gets pyproject.toml (lmkit entry point), the spec, an implementation, tests/.
    """
    from lmkit.scaffold.generate import new_plugin

    if kind in SCAFFOLD_ALIASES:
        print_deprecated(f"--kind {kind}", f"--kind {SCAFFOLD_ALIASES[kind]}")
        kind = SCAFFOLD_ALIASES[kind]
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--dir {directory} is not a directory; give the folder to create "
                          "the package in.")
    try:
        root = new_plugin(name, kind, directory)
    except OSError as e:  # a folder that cannot be created or written
        raise ConfigError(f"cannot write the plugin package into --dir {directory}: "
                          f"{e.strerror or e}") from e
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    print_text(f"created {kind} plugin {name!r} in {root}:")
    for f in files:
        print_text(f"  {f}")
    print_text(f"next: pip install -e {root} && pytest {root / 'tests'}")
