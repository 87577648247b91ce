"""The generated reference docs are committed up to date, and render what they claim."""

from __future__ import annotations

from pathlib import Path

from lmkit.docs_gen import main, render_all, rst_to_md
from lmkit.plugin_host import hookspecs

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"


def test_committed_reference_docs_are_up_to_date() -> None:
    for name, content in render_all().items():
        committed = (REFERENCE / name).read_text(encoding="utf-8")
        assert committed == content, (
            f"docs/reference/{name} is out of date: run `python -m lmkit.docs_gen`")


def test_check_mode_reports_stale_files(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path), "--check"]) == 1
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "hooks.md").write_text("stale\n")
    assert main(["--out", str(tmp_path), "--check"]) == 1


def test_hook_reference_covers_every_hookspec() -> None:
    hooks = render_all()["hooks.md"]
    names = [n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), "lmkit_spec")]
    assert len(names) >= 10
    for name in names:
        assert f"### `{name}`" in hooks


def test_rst_subset_becomes_markdown() -> None:
    text = """Use :class:`~lmkit.api.Spec` and ``x``,
    spanning ``two
    lines``. For example::

        register(spec)

    :param register: call it
        once per spec.
    :return: nothing.
    """
    assert rst_to_md(text) == (
        "Use `Spec` and `x`,\nspanning `two\nlines`. For example:\n\n```python\nregister(spec)\n"
        "```\n\n- `register`: call it once per spec.\n- returns: nothing.\n")
