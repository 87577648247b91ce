"""The GPU test modules' imports from their sibling helper modules resolve.

Without CUDA a GPU test module skips at its top, before its imports run, so a helper
renamed or moved (``tests/gpu/teacher_forcing.py`` took ``test_engine_gpu``'s
``_hf_model`` and ``_check_against_hf`` in 2ebbed6) breaks the module only on a GPU
machine: ``test_deepseek_gpu.py`` failed to collect there from then on. This checks
on the CPU, from the source, that every ``from SIBLING import NAME`` in ``tests/gpu``
(and the other test folders with helper modules, and ``bench/``, whose GPU scripts
import each other) names something the sibling defines at its top level.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
FOLDERS = [TESTS / "gpu", TESTS / "unit" / "eagle", TESTS / "unit", TESTS / "integration",
           TESTS.parent / "bench"]


def top_level_names(path: Path) -> set[str]:
    """Names a module binds at its top level: functions, classes, assignments, imports
    (and those bound inside top-level ``if`` / ``try`` blocks)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                for extra in ("orelse", "finalbody"):
                    visit(getattr(node, extra, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return names


def sibling_imports(folder: Path) -> list[tuple[str, str, str]]:
    """``(module file, sibling module, name)`` for every ``from SIBLING import NAME`` in
    ``folder``'s modules whose ``SIBLING`` is a module file in the same folder."""
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.module and not node.level
                    and (folder / f"{node.module}.py").is_file()):
                found.extend((path.name, node.module, a.name) for a in node.names
                             if a.name != "*")
    return found


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: str(f.relative_to(TESTS.parent)))
def test_sibling_imports_resolve(folder: Path) -> None:
    imports = sibling_imports(folder)
    missing = [f"{module}: from {sibling} import {name}" for module, sibling, name in imports
               if name not in top_level_names(folder / f"{sibling}.py")]
    assert not missing, "names the sibling modules do not define:\n" + "\n".join(missing)


def test_the_check_sees_gpu_helper_imports() -> None:
    """The GPU folder's helpers are imported by name (so the check above has work)."""
    pairs = {(sibling, name) for _, sibling, name in sibling_imports(TESTS / "gpu")}
    assert ("teacher_forcing", "check_against_hf") in pairs
    assert ("test_engine_gpu", "ENGINE") in pairs


def test_a_missing_name_is_reported(tmp_path: Path) -> None:
    (tmp_path / "helper.py").write_text("def present():\n    pass\n")
    (tmp_path / "test_x.py").write_text("from helper import present, gone\n")
    imports = sibling_imports(tmp_path)
    assert imports == [("test_x.py", "helper", "present"), ("test_x.py", "helper", "gone")]
    assert [n for _, s, n in imports if n not in top_level_names(tmp_path / f"{s}.py")] \
        == ["gone"]
