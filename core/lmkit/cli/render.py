"""Terminal output for the CLI: tables, JSON and error paragraphs (rich, no markup
interpretation of user or plugin text)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

# Width when output is piped or captured: wide enough that tables do not fold cells.
PIPE_WIDTH = 200


def stdout() -> Console:
    """A console on standard output (created per call: tests swap ``sys.stdout``)."""
    width = None if sys.stdout.isatty() else PIPE_WIDTH
    return Console(file=sys.stdout, highlight=False, width=width)


def stderr() -> Console:
    """A console on standard error."""
    width = None if sys.stderr.isatty() else PIPE_WIDTH
    return Console(file=sys.stderr, highlight=False, width=width)


def print_error(error: BaseException) -> None:
    """One paragraph on stderr: ``error: <message>``, without a traceback."""
    text = Text("error: ", style="bold red")
    text.append(str(error))
    stderr().print(text, soft_wrap=True)  # the terminal wraps; copied text stays whole


def print_json(data: Any) -> None:
    """Indented JSON on stdout, plain (no colour), so that it can be piped."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def print_table(title: str | None, header: Sequence[str], rows: Sequence[Sequence[Any]],
                styles: Sequence[str | None] | None = None) -> None:
    """A table on stdout; cells are shown literally (``[x]`` is text, not markup)."""
    if title:
        print_text(title, style="bold")  # not a table title: those are padded to full width
    table = Table(show_lines=False, header_style="bold")
    for i, name in enumerate(header):
        style = styles[i] if styles else None
        table.add_column(name, style=style, overflow="fold")
    for row in rows:
        table.add_row(*[Text("" if c is None else str(c)) for c in row])
    stdout().print(table)


def print_text(text: str, style: str | None = None) -> None:
    """A line on stdout, shown literally and not re-wrapped."""
    stdout().print(Text(text, style=style or ""), soft_wrap=True)


def print_deprecated(old: str, new: str) -> None:
    """``warning: OLD is deprecated; use NEW`` on stderr (an old spelling still accepted)."""
    text = Text("warning: ", style="bold yellow")
    text.append(f"{old} is deprecated and will be removed; use {new} instead.")
    stderr().print(text, soft_wrap=True)
