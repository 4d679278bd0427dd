"""Write lora_hotswap_tutorial.ipynb from its source, lora_hotswap_tutorial.py (outputs are added by executing it).

    python notebooks/build_notebook.py                       # cells only, no outputs
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) jupyter nbconvert --to notebook --execute --inplace \
        notebooks/lora_hotswap_tutorial.ipynb                 # run it (cold inductor cache, as a reader's first run)
    python notebooks/fill_readme.py                          # README's generated blocks from the run's results.json
    python notebooks/build_notebook.py --check               # its outputs show no stderr and no machine paths

The source is a jupytext percent-format script, linted and formatted with the package: `# %%` starts a code cell and
`# %% [markdown]` a markdown cell, its lines commented with `# `. The cell titled `README recipe` holds no recipe: this
script writes the ```python block under README.md's "## Plain diffusers recipe" there, as it stands when it runs, so
the notebook runs exactly what the README prints (tests/test_notebook.py checks it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

SOURCE = Path(__file__).with_name("lora_hotswap_tutorial.py")
OUT = SOURCE.with_suffix(".ipynb")
README = Path(__file__).resolve().parents[1] / "README.md"
RECIPE_HEADING = "## Plain diffusers recipe"
RECIPE_CELL = "README recipe"  # the title of the source's cell that the README's recipe fills
HEADER = re.compile(r"^# %%(?: (.*))?\n", re.M)


def readme_recipe(text: str | None = None) -> str:
    """The ```python block under README.md's recipe heading, as it stands (trailing newline included)."""
    section = (README.read_text() if text is None else text).split(f"\n{RECIPE_HEADING}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def uncomment(body: str) -> str:
    """A markdown cell's text from its `# `-commented lines (a bare `#` is an empty line)."""
    lines = []
    for line in body.strip().splitlines():
        if line != "#" and not line.startswith("# "):
            raise ValueError(f"{SOURCE.name}: a markdown cell's line is not a `# ` comment: {line!r}")
        lines.append(line[2:])
    return "\n".join(lines)


def read_cells(text: str, recipe: str) -> list:
    """The notebook's cells from the percent-format source `text`, with `recipe` in the README recipe cell."""
    before, *parts = HEADER.split(text)
    if before.strip():
        raise ValueError(f"{SOURCE.name} must start with a `# %%` cell header")
    cells = []
    for title, body in zip(parts[::2], parts[1::2], strict=True):
        if title == "[markdown]":
            cells.append(new_markdown_cell(uncomment(body)))
        elif title == RECIPE_CELL:
            cells.append(new_code_cell(recipe.removesuffix("\n")))
        elif title is None:
            cells.append(new_code_cell(body.strip()))
        else:
            raise ValueError(f"{SOURCE.name}: unknown cell header `# %% {title}`")
    if sum(title == RECIPE_CELL for title in parts[::2]) != 1:
        raise ValueError(f"{SOURCE.name} needs exactly one `# %% {RECIPE_CELL}` cell")
    return cells


CELLS = read_cells(SOURCE.read_text(), readme_recipe())


# an absolute path of the machine that ran it (a temporary folder, a home, a virtual environment's packages)
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:tmp|home|root|work|usr|opt|var|mnt|Users)/|site-packages|\.venv")


def noise(nb) -> list[str]:
    """What an executed notebook's outputs should not show a reader: anything written to stderr (a library's
    warnings; the tutorial's own teaching ones are printed by `logged`) and the running machine's paths."""
    found = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            text = out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
            text += "".join(out.get("traceback", []))
            if out.get("name") == "stderr":
                found.append(f"cell {i}: stderr: {text.strip()[:160]!r}")
            elif match := MACHINE_PATH.search(text):
                found.append(f"cell {i}: a machine path: {text[max(0, match.start() - 60) : match.end() + 60]!r}")
    return found


def main() -> None:
    if sys.argv[1:] == ["--check"]:  # the executed notebook, as committed
        found = noise(nbformat.read(OUT, as_version=4))
        print("\n".join(found) or f"{OUT.name}: no stderr output, no machine paths")
        raise SystemExit(1 if found else 0)
    nb = new_notebook(cells=CELLS)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, OUT)
    print(f"wrote {OUT} ({len(CELLS)} cells)")


if __name__ == "__main__":
    main()
