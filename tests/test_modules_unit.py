"""The package as docs/how-it-works.md tables it: every module says its one job in its docstring's first line, and
every module and folder of `lora_manager/` has its place in that table (read from the files, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import ROOT

pytestmark = pytest.mark.unit

PACKAGE = ROOT / "lora_manager"
HOW_IT_WORKS = ROOT / "docs" / "how-it-works.md"


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "presets" not in p.parts and p.name != "__main__.py")


def _table() -> dict[str, str]:
    """The module table's first column (its names, backquoted) -> the row."""
    rows = [line for line in HOW_IT_WORKS.read_text().splitlines() if line.startswith("| `")]
    return {cell: row for row in rows for cell in row.split("|")[1].replace("`", "").replace(",", " ").split()}


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_states_its_job_first(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and len(doc.splitlines()[0]) > 20, f"{path.relative_to(ROOT)} needs a docstring saying its one job"


def test_every_module_has_its_row_in_the_module_table():
    table = _table()
    missing = []
    for path in _modules():
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1:
            if rel.name != "__init__.py" and rel.name not in table:
                missing.append(str(rel))
        elif (folder := f"{rel.parts[0]}/") not in table and f"{rel.parts[0]}/," not in table:
            missing.append(f"{folder} (the folder)")
        elif rel.stem != "__init__" and f"`{rel.stem}`" not in table.get(folder, "") and len(rel.parts) == 2:
            missing.append(str(rel))
    assert not missing, f"not in docs/how-it-works.md's module table: {missing}"
