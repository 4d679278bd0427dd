"""Every package installed in this interpreter's environment must be pinned in the given requirement files (and the
files they include with -r), at the pinned version: a run sees exactly what a new user gets."""

import re
import sys
from importlib.metadata import distributions
from pathlib import Path


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            found.update(pins(path.parent / line[3:].strip()))
        elif "==" in line:
            name, version = line.split("==")
            found[norm(name.split("[")[0])] = version
    return found


wanted = {k: v for f in sys.argv[1:] for k, v in pins(Path(f)).items()}
tooling = {"pip", "setuptools", "wheel", "lora-hotswap"}  # lora-hotswap: this repository, installed editable
found = {norm(d.metadata["Name"]): d.version.split("+")[0] for d in distributions()}
bad = sorted(f"{n}=={v} (pinned: {wanted.get(n, 'not pinned')})" for n, v in found.items()
             if n not in tooling and wanted.get(n) != v)
missing = sorted(set(wanted) - set(found))
if bad or missing:
    raise SystemExit(f"packages outside the pins: {bad}; pinned but not installed: {missing}")
print(f"{len(found) - len(tooling & set(found))} packages installed, each at its pinned version")
