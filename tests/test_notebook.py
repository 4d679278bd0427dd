"""The tutorial notebook: its cells come from its source, notebooks/lora_hotswap_tutorial.py (written out by
build_notebook.py), its numbers reach the README through one JSON file (notebooks/figures/results.json, written by the
run, turned into README blocks by notebooks/fill_readme.py), and it runs end to end, offline, on a copy: the committed
notebook and JSON keep what the committed run wrote."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from nbconvert.preprocessors import ExecutePreprocessor

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOK = NOTEBOOKS / "lora_hotswap_tutorial.ipynb"
RESULTS = NOTEBOOKS / "figures" / "results.json"
README = NOTEBOOKS.parent / "README.md"
# Per cell: room for the longest cell (the README recipe, with the notebook's one inductor compile) on 2 CPU cores
# with a cold inductor cache.
CELL_TIMEOUT_S = 300
RECIPE_HEADING = "## Plain diffusers recipe"
# Markdown words a reader goes through before the pitfalls and deep dives (the main path).
MAIN_PATH_WORDS = 1500


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, NOTEBOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recap_markdown(nb) -> str:
    """The results table the notebook's last code cell displayed."""
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    shown = [o["data"]["text/markdown"] for o in last.outputs if "text/markdown" in o.get("data", {})]
    assert len(shown) == 1, "the last code cell shows one results table"
    return shown[0]


def test_notebook_matches_its_generator():
    """The .ipynb is written by build_notebook.py from its source: the committed cells must be the source's cells."""
    build = _module("build_notebook")
    committed = nbformat.read(NOTEBOOK, as_version=4)
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in build.CELLS]


def _readme_recipe() -> str:
    """The ```python block under README.md's recipe heading (what tests/test_recipe.py runs)."""
    section = README.read_text().split(f"\n{RECIPE_HEADING}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_recipe_cell_is_the_readme_recipe():
    """Section 2 runs the README's recipe as printed: exactly one code cell of the committed notebook is the block
    under "## Plain diffusers recipe" (less its final newline), so the two cannot drift apart."""
    committed = nbformat.read(NOTEBOOK, as_version=4)
    recipe = _readme_recipe().removesuffix("\n")
    assert [c.source for c in committed.cells if c.cell_type == "code"].count(recipe) == 1


def test_main_path_is_short():
    """The markdown before the pitfalls and deep dives reads in about ten minutes."""
    words = 0
    for cell in nbformat.read(NOTEBOOK, as_version=4).cells:
        if cell.cell_type != "markdown":
            continue
        before, *rest = re.split(r"^## (?:\d+\. Pitfalls|Deep dive)", cell.source, flags=re.M)
        words += len(before.split())
        if rest:
            break
    assert words <= MAIN_PATH_WORDS, words


def test_readme_blocks_are_the_committed_results():
    """Every generated block (README.md, docs/performance.md) equals what fill_readme.py writes from the committed
    JSON files: a page quoting another run fails here (fix: python notebooks/fill_readme.py)."""
    fill = _module("fill_readme")
    data = fill.load(RESULTS)
    current = fill.blocks()
    assert current == {name: render(data) for name, render in fill.BLOCKS.items()}


def test_committed_notebook_outputs_are_the_committed_results():
    """The committed notebook's recap table is the committed results.json: the notebook, the JSON and the README
    come from one run."""
    fill = _module("fill_readme")
    assert _recap_markdown(nbformat.read(NOTEBOOK, as_version=4)) == fill.results_table(fill.load(RESULTS))


def test_committed_outputs_show_no_library_noise_or_machine_paths():
    assert _module("build_notebook").noise(nbformat.read(NOTEBOOK, as_version=4)) == []


@pytest.mark.notebook
def test_notebook_runs_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the kernel inherits it: nothing may come from the network
    results = tmp_path / "results.json"
    monkeypatch.setenv("LORA_TUTORIAL_RESULTS", str(results))  # not the committed JSON the README is filled from
    before = NOTEBOOK.read_bytes(), RESULTS.read_bytes()
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
    assert _module("build_notebook").noise(nb) == []
    fill = _module("fill_readme")
    fresh, committed = fill.load(results), fill.load(RESULTS)
    assert _recap_markdown(nb) == fill.results_table(fresh)
    assert [r["key"] for r in fresh["results"]] == [r["key"] for r in committed["results"]]
    for render in fill.BLOCKS.values():
        render(fresh)  # a fresh run can fill every README block
    assert (NOTEBOOK.read_bytes(), RESULTS.read_bytes()) == before, "the committed notebook or results were modified"
