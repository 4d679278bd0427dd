"""The tutorial notebook runs end to end, offline, on a copy: the committed notebook keeps its outputs untouched."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import nbformat
import pytest
from nbconvert.preprocessors import ExecutePreprocessor

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOK = NOTEBOOKS / "lora_hotswap_tutorial.ipynb"
# Generous: on 2 CPU cores a cold inductor cache takes minutes for the compile cell and again for the recompile demo.
CELL_TIMEOUT_S = 1800


def test_notebook_matches_its_generator():
    """The .ipynb is written by build_notebook.py: the committed cells must be the generator's cells."""
    spec = importlib.util.spec_from_file_location("build_notebook", NOTEBOOKS / "build_notebook.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    committed = nbformat.read(NOTEBOOK, as_version=4)
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in build.CELLS]


@pytest.mark.notebook
def test_notebook_runs_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the kernel inherits it: nothing may come from the network
    before = NOTEBOOK.read_bytes()
    copy = tmp_path / NOTEBOOK.name
    shutil.copy(NOTEBOOK, copy)
    nb = nbformat.read(copy, as_version=4)

    executor = ExecutePreprocessor(timeout=CELL_TIMEOUT_S, kernel_name="python3")
    try:
        executor.preprocess(nb, {"metadata": {"path": str(NOTEBOOKS)}})  # raises CellExecutionError on any cell error
    finally:
        nbformat.write(nb, copy)  # the executed copy, for a look after a failure

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "not every code cell ran"
    last = "".join(o.get("text", "") for o in code[-1].outputs)
    assert "notebook ran in" in last, f"the last cell did not finish: {last!r}"
    assert NOTEBOOK.read_bytes() == before, "the committed notebook was modified"
