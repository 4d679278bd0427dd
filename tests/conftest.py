"""Fixtures and hooks: each pytest-xdist worker's share of the machine, the markers, the shared test adapters and the
engines over them. Torch is imported only by the fixtures and hooks that need it, so a run of `unit` tests never
imports it, and the hooks below fail such a run that does."""

from __future__ import annotations

import getpass
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from lora_manager import LoraManager

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Under pytest-xdist each worker (and every process its tests start) takes its share of the cores, since OpenMP
# threads of two workers on one core wait on each other, and its own inductor cache, so that files one worker's
# compiles write never appear in another's (test_aot asserts that serving from a package adds none).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES = max(1, (os.cpu_count() or 1) // WORKERS)  # this process's share


def inductor_default_cache() -> str:
    """torch's default inductor cache folder (tempdir/torchinductor_<user>), found without importing torch, which must
    come after OMP_NUM_THREADS is set."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = (
        f"{os.environ.get('TORCHINDUCTOR_CACHE_DIR') or inductor_default_cache()}_{worker}"
    )
    os.environ["OMP_NUM_THREADS"] = str(CORES)

SLOW = ("compile", "browser", "app", "ray", "notebook")  # markers registered in pyproject.toml
HEAVY = ("torch", "diffusers")  # what a run of unit tests never imports
UNIT_ONLY = pytest.StashKey[bool]()  # whether this process runs unit tests only

# Under pytest-xdist (`.ci/run`: `-n auto`) each test file runs whole on one worker, so its module fixtures (a compiled
# engine, a running app) are built once. The files that start a local Ray instance share one worker, so two Ray
# instances never run at once, and so do the files that use the session's compiled engine, so it is compiled once.
WORKER_GROUPS = {
    "test_fresh_machine.py": "ray",
    "test_hostile_inputs.py": "ray",
    "test_ray_serve.py": "ray",
    "test_engine.py": "compiled_manager",
    "test_failures.py": "compiled_manager",
    "test_slots.py": "compiled_manager",
    "test_swap_faults.py": "compiled_manager",
}


def is_unit_module(path: Path) -> bool:
    """Unit tests live in tests/test_*_unit.py, and only there (pytest_collection_modifyitems holds both ways)."""
    return path.name.startswith("test_") and path.stem.endswith("_unit")


def selects_only_unit(config) -> bool:
    """`-m unit`, alone or and-ed with more (`-m "unit and not slow"`), can select nothing outside the unit modules."""
    expression = (config.getoption("markexpr") or "").strip()
    return bool(re.fullmatch(r"unit(\s+and\s+.*)?", expression)) and not re.search(r"\bor\b", expression)


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """Under `-m unit` the other test modules are not even imported: they import torch, which unit tests never do."""
    if collection_path.suffix == ".py" and selects_only_unit(config) and not is_unit_module(collection_path):
        return True
    return None


def pytest_collection_modifyitems(items) -> None:
    """A test that uses the compiled engine is a `compile` test; every test with a slow part is `slow`. A Ray or
    compiled-engine test outside its WORKER_GROUPS file, or a unit test outside a unit module (or the other way
    round), fails the collection, so the groups cannot fall behind."""
    for item in items:
        if "compiled_manager" in getattr(item, "fixturenames", ()):
            item.add_marker("compile")
            if WORKER_GROUPS.get(item.path.name) != "compiled_manager":
                raise pytest.UsageError(f"{item.path.name} uses compiled_manager: add it to WORKER_GROUPS")
        if item.get_closest_marker("ray") and WORKER_GROUPS.get(item.path.name) != "ray":
            raise pytest.UsageError(f"{item.path.name} starts Ray: add it to WORKER_GROUPS")
        if bool(item.get_closest_marker("unit")) != is_unit_module(item.path):
            raise pytest.UsageError(f"{item.nodeid}: unit tests, and only they, live in test_*_unit.py modules")
        if any(item.get_closest_marker(m) for m in SLOW):
            item.add_marker("slow")


def imported_heavy() -> list[str]:
    return [name for name in HEAVY if name in sys.modules]


def pytest_collection_finish(session) -> None:
    """Once the test modules are imported: torch (if one of them imported it) uses at most two of this process's
    cores; a run of unit tests only is flagged, and fails here if collecting it imported torch or diffusers."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(min(2, CORES))
    unit_only = bool(session.items) and all(item.get_closest_marker("unit") for item in session.items)
    session.config.stash[UNIT_ONLY] = unit_only
    if unit_only and (heavy := imported_heavy()):
        raise pytest.UsageError(f"importing the unit test modules imported {heavy}: unit tests import neither")


def pytest_runtest_teardown(item) -> None:
    """In a run of unit tests only, the first test that imports torch or diffusers (directly or through the package)
    fails at its teardown."""
    if item.config.stash.get(UNIT_ONLY, False) and (heavy := imported_heavy()):
        pytest.fail(f"{item.nodeid} imported {heavy}: a unit test imports neither torch nor diffusers")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it installed, never called
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's file scheduling, with the files in one WORKER_GROUPS entry as one unit (for `-n`'s default
    `--dist load`; any other `--dist` is left to pytest-xdist)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return WORKER_GROUPS.get(Path(file).name, file)

    return FileGroups(config, log)


@pytest.fixture(scope="session")
def adapter_dir(tmp_path_factory) -> Path:
    """Every adapter of engine_helpers.ADAPTERS, written once for the run as real safetensors files."""
    from lora_manager.testing import write_adapter

    from engine_helpers import ADAPTERS, load_tiny

    folder = tmp_path_factory.mktemp("adapters")
    pipe = load_tiny()
    for name, kw in ADAPTERS.items():
        write_adapter(pipe, folder / f"{name}.safetensors", **kw)
    return folder


@pytest.fixture(scope="session")
def manager(adapter_dir) -> LoraManager:
    """An eager engine over all test adapters. Tests serve from it but never register, unregister or reconfigure it:
    a test that changes an engine builds its own."""
    from lora_manager import LoraManager

    from engine_helpers import load_tiny, make_catalog

    return LoraManager(load_tiny(), make_catalog(adapter_dir))


@pytest.fixture(scope="session")
def compiled_manager(adapter_dir) -> LoraManager:
    """One compiled engine for the whole run (inductor takes a minute or two on a 2-core CPU), with two hotswap slots so
    one-adapter, two-adapter and no-adapter requests all run through the same compiled graphs."""
    from lora_manager import LoraManager

    from engine_helpers import load_tiny, make_catalog

    return LoraManager(load_tiny(), make_catalog(adapter_dir), compile=True, slots=2)
