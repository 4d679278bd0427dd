"""`pip install <repo>` gives someone else's Space or script a working `lora_manager`, embedded preset included."""

from __future__ import annotations

import shutil
import site
import subprocess
import venv
from pathlib import Path

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow  # builds and installs the package into a new virtual environment

USE = """
import lora_manager, pathlib
assert "site-packages" in lora_manager.__file__, lora_manager.__file__
from lora_manager import LoraManager
with LoraManager.from_preset("tiny") as m:
    r = m.generate("a red circle on a blue background", adapter="frame", steps=2)
print("ok", r.image.size, r.info["base_model"], len(m.adapters()))
"""


def test_pip_install_of_the_repo_serves_the_embedded_preset(tmp_path):
    source = tmp_path / "src"  # a copy: the build writes its metadata next to the sources
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "build", "notebooks", "tests"),
    )
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # the package itself from the copy; its dependencies (already tested) from this interpreter's site-packages
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", str(source)], capture_output=True, text=True, timeout=600
    )
    assert install.returncode == 0, install.stderr[-3000:]
    own = subprocess.run(
        [python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True
    ).stdout.strip()
    (Path(own) / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    out = subprocess.run([python, "-c", USE], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok (64, 64) tiny/model 6"), out.stdout
