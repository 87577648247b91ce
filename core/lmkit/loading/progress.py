"""Progress reporting for fetching and converting models: rich bars and status lines on
stderr when enabled, silence when not (tests, ``progress=False``, servers)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def announce(message: str, enabled: bool) -> None:
    """Print one status line (``lmkit: <message>``) on stderr if ``enabled``."""
    if enabled:
        _console().print(f"[bold]lmkit[/bold]: {message}", highlight=False)


@contextlib.contextmanager
def byte_bar(total: int, description: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A bytes progress bar; yields ``advance(num_bytes)``. A no-op when disabled."""
    if not enabled:
        yield lambda _n: None
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
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


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
