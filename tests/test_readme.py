"""Every code block in README.md runs as written, from the repo's root, offline: each ```python block as a script and
each ```bash block with `bash -e`, in a folder that holds only a link to the package (so what they write stays out of
the checkout). A block whose first line says it needs the Hub or a GPU is skipped, and so are the blocks another test
runs as written: the two set-up commands (`python app.py` by the app tests, `bash .ci/run` is the test run itself),
the recipe (tests/test_recipe.py) and the tutorial's refresh command (tests/test_notebook.py executes the notebook)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_ELSEWHERE = {  # README section -> the test that runs its blocks
    "Set up": "tests/test_app_api.py starts `python app.py`; `bash .ci/run` is this run",
    "Plain diffusers recipe": "tests/test_recipe.py",
    "The tutorial": "tests/test_notebook.py",
    "Scale out": "tests/test_ray_serve.py (the openai client call and /metrics, against `serve`)",
}
NEEDS = re.compile(r"^#\s*needs (the Hub|a GPU)", re.I)

pytestmark = pytest.mark.slow  # each block starts a Python that imports torch and diffusers


def blocks() -> list[tuple[str, str, str]]:
    """(section, language, code) of every fenced block, in order."""
    found, section = [], ""
    for part in re.split(r"(^## [^\n]*$|^```\w*\n.*?^```$)", (ROOT / "README.md").read_text(), flags=re.M | re.S):
        if part.startswith("## "):
            section = part[3:].strip()
        elif part.startswith("```"):
            language, _, code = part[3:].partition("\n")
            found.append((section, language, code.removesuffix("```")))
    return found


def runnable() -> list:
    return [
        pytest.param(lang, code, id=f"{section}-{i}")
        for i, (section, lang, code) in enumerate(blocks())
        if section not in RUN_ELSEWHERE and not NEEDS.match(code)
    ]


def test_every_block_is_run_here_or_by_the_test_named_for_its_section():
    assert {lang for _, lang, _ in blocks()} <= {"python", "bash"}
    assert {section for section, _, _ in blocks()} >= set(RUN_ELSEWHERE)
    assert len(runnable()) >= 3


@pytest.mark.parametrize("language, code", runnable())
def test_block_runs_as_written(language, code, tmp_path):
    (tmp_path / "lora_manager").symlink_to(ROOT / "lora_manager")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    command = [sys.executable, "-c", code] if language == "python" else ["bash", "-e", "-c", code]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
