"""Shared fixtures: the shipped tiny pipeline, real LoRA files written for it, and engines over them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Under pytest-xdist each worker (and every process its tests start) takes its share of the cores, since OpenMP
# threads of two workers on one core wait on each other, and its own inductor cache, so that files one worker's
# compiles write never appear in another's (test_aot asserts that serving from a package adds none).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES = max(1, (os.cpu_count() or 1) // WORKERS)  # this process's share
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = (
        f"{os.environ.get('TORCHINDUCTOR_CACHE_DIR') or default_cache_dir()}_{worker}"
    )
    os.environ["OMP_NUM_THREADS"] = str(CORES)
torch.set_num_threads(min(2, CORES))

from diffusers import StableDiffusionPipeline  # noqa: E402

from lora_manager import AdapterSpec, Catalog, LoraManager  # noqa: E402
from lora_manager.adapters.inspection import BLOCKS  # noqa: E402
from lora_manager.testing import same_slots, snapshot, write_adapter  # noqa: E402

TINY_MODEL = ROOT / "lora_manager" / "presets" / "tiny" / "model"
GEN = {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 4.0}
PROMPT = "a red circle on a blue background"
# Adapters that between them cover what the engine must handle: ranks 4..16 with an odd one, alphas above, below
# and not a multiple of the rank, attention-only and attention+ff+conv targets, kohya keys, text-encoder parts.
ADAPTERS = {
    "r4_attn": dict(rank=4, alpha=4, seed=1),
    "r7_conv": dict(rank=7, alpha=11, suffixes=BLOCKS, seed=2),
    "r16_half": dict(rank=16, alpha=8, seed=3),
    "r8_kohya": dict(rank=8, alpha=16, kohya=True, seed=4),
    "r6_te": dict(rank=6, alpha=3, te_rank=6, te_alpha=12, seed=5),
    "r4_kohya_te": dict(rank=4, alpha=2, te_rank=4, te_alpha=8, kohya=True, seed=6),
}


SLOW = ("compile", "browser", "app", "ray", "notebook")  # markers registered in pyproject.toml


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
}


def pytest_collection_modifyitems(items) -> None:
    """A test that uses the compiled engine is a `compile` test; every test with a slow part is `slow`. A Ray or
    compiled-engine test outside its WORKER_GROUPS file fails the collection, so the groups cannot fall behind."""
    for item in items:
        if "compiled_manager" in getattr(item, "fixturenames", ()):
            item.add_marker("compile")
            if WORKER_GROUPS.get(item.path.name) != "compiled_manager":
                raise pytest.UsageError(f"{item.path.name} uses compiled_manager: add it to WORKER_GROUPS")
        if item.get_closest_marker("ray") and WORKER_GROUPS.get(item.path.name) != "ray":
            raise pytest.UsageError(f"{item.path.name} starts Ray: add it to WORKER_GROUPS")
        if any(item.get_closest_marker(m) for m in SLOW):
            item.add_marker("slow")


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


def load_tiny(dtype: torch.dtype = torch.float32) -> StableDiffusionPipeline:
    pipe = StableDiffusionPipeline.from_pretrained(TINY_MODEL, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def adapter_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("adapters")
    pipe = load_tiny()
    for name, kw in ADAPTERS.items():
        write_adapter(pipe, folder / f"{name}.safetensors", **kw)
    return folder


def make_catalog(adapter_dir: Path, names=tuple(ADAPTERS)) -> Catalog:
    specs = tuple(AdapterSpec(id=n, source=str(adapter_dir / f"{n}.safetensors")) for n in names)
    return Catalog(name="test", base_model=str(TINY_MODEL), adapters=specs, generation=GEN)


@pytest.fixture(scope="session")
def manager(adapter_dir) -> LoraManager:
    """An eager engine over all test adapters."""
    return LoraManager(load_tiny(), make_catalog(adapter_dir))


@pytest.fixture(scope="session")
def compiled_manager(adapter_dir) -> LoraManager:
    """One compiled engine for the whole run (inductor takes a minute or two on a 2-core CPU), with two hotswap slots so
    one-adapter, two-adapter and no-adapter requests all run through the same compiled graphs."""
    return LoraManager(load_tiny(), make_catalog(adapter_dir), compile=True, slots=2)


def reference(adapter_path: Path | None, strength: float = 1.0, seed: int = 0, prompt: str = PROMPT) -> np.ndarray:
    """What a fresh plain-diffusers pipeline gives with only that adapter loaded by `load_lora_weights`."""
    return mix_reference([(adapter_path, strength)] if adapter_path is not None else [], seed, prompt)


def mix_reference(
    adapters: list[tuple[Path, float]], seed: int = 0, prompt: str = PROMPT, dtype: torch.dtype = torch.float32
) -> np.ndarray:
    """Plain diffusers with each adapter loaded normally, combined by `set_adapters(names, strengths)`."""
    pipe = load_tiny(dtype)
    for i, (path, _) in enumerate(adapters):
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=f"ref{i}")
    if adapters and (len(adapters) > 1 or adapters[0][1] != 1.0):
        pipe.set_adapters([f"ref{i}" for i in range(len(adapters))], [s for _, s in adapters])
    # PEFT adds lora_dropout modules in training mode: without eval() plain diffusers applies dropout at inference.
    pipe.unet.eval()
    pipe.text_encoder.eval()
    gen = torch.Generator("cpu").manual_seed(seed)
    return pipe(prompt, generator=gen, output_type="np", **GEN).images[0]


def as_float(manager: LoraManager, adapter: str | None, strength: float = 1.0, seed: int = 0) -> np.ndarray:
    return manager.generate(PROMPT, adapter=adapter, strength=strength, seed=seed, output_type="np").image


def one(adapter: str | None, strength: float) -> tuple:
    """The engine's request form (a Mix) for a single adapter, for tests that call `residency.make_resident`."""
    return ((adapter, strength),) if adapter else ()


def break_while_evicted(
    m: LoraManager, adapter_dir: Path, victim: Path, monkeypatch, resident: tuple[str, ...]
) -> None:
    """Evict every adapter but `resident` from the CPU cache (a budget that holds only them and one filler), then
    empty the evicted `victim` file: the engine finds it broken only when it re-reads it."""
    monkeypatch.setattr(m.store, "budget_bytes", sum(m.info(a).bytes for a in resident) + m.info("r6_te").bytes)
    m.register("filler", str(adapter_dir / "r6_te.safetensors"))  # evicts every adapter not resident
    monkeypatch.undo()
    assert m.info("victim").status == "evicted"
    victim.write_bytes(b"")


def snapshot_slots(manager: LoraManager) -> list[dict]:
    return snapshot(manager.residency.mix_slots)


def assert_same_slots(before: list[dict], after: list[dict]) -> None:
    """Every slot's A, B and scaling bit-identical."""
    assert same_slots(before, after)
