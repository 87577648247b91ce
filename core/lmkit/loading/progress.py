"""Progress reporting for fetching and converting models: rich bars and status lines on
stderr when enabled, silence when not (tests, ``progress=False``).

On a terminal, bars and spinners redraw in place; when stderr is a file or a pipe (a
log, CI, a supervisor), the same progress is written as plain lines: a bar reports
every tenth of its total, a step reports when it starts and how long it took, so a log
never holds a long silence.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterator
from functools import lru_cache
from typing import Any, Protocol

LINE_STEPS = 10  # a bar on a non-terminal reports every 1/LINE_STEPS of its total


class Advance(Protocol):
    """What :func:`byte_bar` yields: count bytes done, and the total once known."""

    def __call__(self, n: int, total: int | None = None) -> None: ...


@lru_cache(maxsize=1)
def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def announce(message: str, enabled: bool) -> None:
    """Print one status line (``lmkit: <message>``) on stderr if ``enabled``."""
    if enabled:
        # soft_wrap: a log line stays one line, whatever the console's width
        _console().print(f"[bold]lmkit[/bold]: {message}", highlight=False, soft_wrap=True)


def format_bytes(n: float) -> str:
    """``93.1 MB``: a byte count in decimal units, as pip and rich show them."""
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class LineBar:
    """A byte bar written as lines (``lmkit: downloading: 46.6 of 93.1 MB (50%)``), one per
    tenth of ``total``; with no total (0), one per ``every_s`` seconds."""

    def __init__(self, total: int, description: str, every_s: float = 5.0) -> None:
        self.total, self.description, self.every_s = total, description, every_s
        self.done = 0
        self._next_step = 1
        self._last_line = time.monotonic()

    def advance(self, n: int, total: int | None = None) -> None:
        """Count ``n`` more bytes (and learn the ``total`` if given); print a line when a
        reporting point is passed."""
        self.done += n
        if total:
            self.total = total
        if self.total > 0:
            step = min(LINE_STEPS, self.done * LINE_STEPS // self.total)
            if step >= self._next_step:
                self._next_step = step + 1
                announce(f"{self.description}: {format_bytes(self.done)} of "
                         f"{format_bytes(self.total)} ({100 * step // LINE_STEPS}%)", True)
        elif time.monotonic() - self._last_line >= self.every_s:
            self._last_line = time.monotonic()
            announce(f"{self.description}: {format_bytes(self.done)}", True)


@contextlib.contextmanager
def byte_bar(total: int, description: str, enabled: bool) -> Iterator[Advance]:
    """A bytes progress bar; yields ``advance(num_bytes, total=None)`` (``total``: the
    size once it is known; 0 at the start means unknown). A no-op when disabled; plain
    lines (:class:`LineBar`) when stderr is not a terminal."""
    if not enabled:
        yield lambda _n, total=None: None
        return
    if not _console().is_terminal:
        yield LineBar(total, description).advance
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=_console(), transient=False) as bar:
        task = bar.add_task(description, total=total or None)

        def advance(n: int, total: int | None = None) -> None:
            bar.update(task, advance=n, **({"total": total} if total else {}))

        yield advance


@contextlib.contextmanager
def step(message: str, enabled: bool, spinner: bool = True) -> Iterator[None]:
    """Long work whose progress cannot be measured (one library call): a spinner with
    the elapsed time while it runs on a terminal, a start line elsewhere, and
    ``lmkit: <message>: done in N.N s`` at the end. Silent when not ``enabled``.

    ``spinner=False`` prints the start line on a terminal too: for work that draws its
    own bars (a spinner would hold their output back until it stops).
    """
    if not enabled:
        yield
        return
    start = time.monotonic()
    console = _console()
    if console.is_terminal and spinner:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=console, transient=True) as spinner:
            spinner.add_task(f"lmkit: {message}", total=None)
            yield
    else:
        announce(f"{message} ...", True)
        yield
    announce(f"{message}: done in {time.monotonic() - start:.1f} s", True)


@contextlib.contextmanager
def library_progress(enabled: bool) -> Iterator[None]:
    """Let transformers show its own tqdm bars only if ``enabled``.

    When disabled, transformers' progress switch is turned off and Python-level stderr
    is redirected to a discarded buffer (some of its bars use tqdm directly). Both are
    process-wide, so the previous state is restored on exit.
    """
    if enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
