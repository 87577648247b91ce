"""Developer sessions: ``nox -s tests lint typecheck docs``.

The sessions run in the current environment (``venv_backend="none"``): torch and the
model files are large, so the environment is set up once with the README's commands
(``pip install torch==2.13.0 && pip install -e ".[test,dev]"``) rather than per session.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "docs", "tests"]
nox.options.error_on_missing_interpreters = True


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The test suite; extra arguments go to pytest (``nox -s tests -- -k config``)."""
    session.run("pytest", "-q", "-n", "2", "--dist", "loadfile", *session.posargs,
                env={"OMP_NUM_THREADS": "1"})  # as the README's command and CI run it


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff and the import-boundary contracts (lint-imports).

    Core never imports plugins or heavy libraries; plugins use only the public lmkit API.
    """
    session.run("ruff", "check", ".")
    session.run("lint-imports")


@nox.session(venv_backend="none")
def typecheck(session: nox.Session) -> None:
    """mypy on the plugin contract, the configuration and the public API.

    The checked packages are listed under [tool.mypy] in pyproject.toml.
    """
    session.run("mypy")


@nox.session(venv_backend="none")
def docs(session: nox.Session) -> None:
    """Fail if the generated reference docs are out of date.

    ``python -m lmkit.docs_gen`` rewrites docs/reference/{hooks,config}.md.
    """
    session.run("python", "-m", "lmkit.docs_gen", "--check")
