"""How ``--help`` shows lmkit's commands: flags without a type (``--raw``, not
``--raw <bool>``), arguments in capitals in the usage line (``NAME``, ``[NAME]`` when
optional) instead of typer's ``{name}``.

:func:`apply_help_style` gives every command and group registered on an app these
classes, so that built-in commands, plugin commands and sub-groups read alike.
"""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption


class _FlagStyle:
    """Flags (and ``--help``) take no value: show no type for them; arguments are
    named in capitals."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.metavar = ""
        return option

    def get_params(self, ctx: Any) -> list[Any]:
        params: list[Any] = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if param.metavar is not None:
                continue
            if isinstance(param, TyperOption) and param.is_flag:
                param.metavar = ""
            elif isinstance(param, TyperArgument) and param.name:
                param.metavar = param.name.upper()
        return params


class LMKitCommand(_FlagStyle, TyperCommand):
    """A command whose usage line reads ``lmkit plugin new [OPTIONS] NAME``."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar or (param.name or "").upper()
                name = name if param.required else f"[{name}]"
                pieces.append(name + ("..." if param.nargs != 1 else ""))
        return pieces


class LMKitSubGroup(_FlagStyle, TyperGroup):
    """A command group (``lmkit config``, ``lmkit plugins``) in lmkit's help style."""


def apply_help_style(app: typer.Typer) -> None:
    """Give every command and group registered on ``app`` (recursively) lmkit's help
    classes, unless its author chose a class of their own."""
    for command in app.registered_commands:
        if _is_default(command.cls, TyperCommand):
            command.cls = LMKitCommand
    for group in app.registered_groups:
        sub = group.typer_instance
        if sub is None:
            continue
        if _is_default(group.cls, TyperGroup) and _is_default(sub.info.cls, TyperGroup):
            group.cls = LMKitSubGroup
        apply_help_style(sub)


def _is_default(cls: Any, default: type) -> bool:
    """Whether a registered ``cls`` is typer's default (unset, a placeholder, or the
    default class itself, which some typer versions fill in)."""
    return not isinstance(cls, type) or cls is default
