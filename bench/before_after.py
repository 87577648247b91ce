"""Alternating before/after rounds for the CPU benchmarks that time a git revision
against the working tree (``output_processing.py``, ``scheduler_step.py``)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def revision_tree(rev: str, folder: str, into: Path) -> Path:
    """The checkout's ``folder`` (``core``, ``plugins``) as of git revision ``rev``,
    extracted under ``into``; returns ``into / folder``."""
    archive = into / f"{folder}.tar"
    subprocess.run(["git", "archive", "-o", str(archive), rev, folder], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / folder


def env_first_on_path(path: Path | None) -> dict[str, str]:
    """This process's environment with ``path`` first on ``PYTHONPATH`` (a revision's
    packages imported before the working tree's); unchanged for ``None``."""
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    return env


def time_side(core: Path | None, module: str, call: str) -> float:
    """The float a bench function prints, run in a fresh process with ``core``'s lmkit
    first on the path (``None``: the working tree's): ``call`` is an expression over the
    bench module ``module`` of this folder, e.g. ``time_steps(32, 256)``."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import {module} as s; print(s.{call})")
    out = subprocess.run([sys.executable, "-c", code], env=env_first_on_path(core), check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def before_after(label: str, run: Callable[[str], float], rounds: int) -> dict[str, list[float]]:
    """Run ``run("before")`` and ``run("after")`` (seconds per step) ``rounds`` times each,
    the order alternating round by round; print ``label``'s medians, their ratio and every
    round (microseconds per step), and return the rounds by side."""
    times: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(rounds):
        for name in (("before", "after") if r % 2 else ("after", "before")):
            times[name].append(run(name))
    med = {name: statistics.median(t) for name, t in times.items()}
    rounds_text = "; ".join(f"{name} {', '.join(f'{1e6 * t:.0f}' for t in ts)}"
                            for name, ts in times.items())
    print(f"{label}: before {1e6 * med['before']:8.1f} us/step  after "
          f"{1e6 * med['after']:8.1f} us/step  ({med['before'] / med['after']:.2f}x)  "
          f"rounds {rounds_text}", flush=True)
    return times
