"""The GPU presets end to end, with nothing downloaded: a local stand-in Hub serves a small pipeline of each preset's
architecture under the preset's exact base-model repo id (with "fp16" weight files beside the float32 ones where the
real repo has them), and LoRA files of real formats under each catalog adapter's exact repo id and file name.
`LoraManager.from_preset` then reads the catalog, fills a fresh Hugging Face cache, builds the engine in the preset's
dtype, and the Space's Blocks are built on it; every adapter of the catalog serves an image."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from lora_manager import LoraManager
from lora_manager.adapters.catalog import load_preset
from lora_manager.bench.mini_pipelines import FLUX_GEN, SDXL_GEN, mini_flux, mini_sdxl

from helpers import ROOT
from hub_server import HubServer, Repo, hub_env
from lora_formats import flux_files, sd15_files, sdxl_files

pytestmark = pytest.mark.slow  # three pipelines saved, served, downloaded and built: about a minute


def tiny_sd15() -> DiffusionPipeline:
    """The embedded model: SD 1.5's pipeline class and module names at a small width."""
    return DiffusionPipeline.from_pretrained(ROOT / "lora_manager" / "presets" / "tiny" / "model")


# preset -> (a small pipeline of its architecture, its LoRA file formats, whether its repo has fp16 files, settings)
ARCHITECTURES = {
    "sd15": (tiny_sd15, sd15_files, True, {"height": 64, "width": 64}),
    "sdxl": (mini_sdxl, sdxl_files, True, {k: SDXL_GEN[k] for k in ("height", "width")}),
    "flux": (mini_flux, flux_files, False, {k: FLUX_GEN[k] for k in ("height", "width", "max_sequence_length")}),
}


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def stand_in_hub(preset: str, tmp_path: Path) -> dict[str, Repo]:
    """The preset's base model and adapters, under the catalog's repo ids and file names."""
    build, formats, has_fp16, _ = ARCHITECTURES[preset]
    catalog, _ = load_preset(preset)
    pipe = build()
    model = tmp_path / "model"
    pipe.save_pretrained(model)
    if has_fp16:
        pipe.to(torch.float16).save_pretrained(model, variant="fp16")
    repos = {catalog.base_model: Repo({"main": folder_bytes(model)})}
    (tmp_path / "loras").mkdir()
    files = formats(build(), tmp_path / "loras")
    for spec, lora in zip(catalog.adapters, itertools.cycle(files.values())):
        name = spec.weight_name or "lora.safetensors"
        repos.setdefault(spec.source, Repo({"main": {}})).revisions["main"][name] = lora.path.read_bytes()
    return repos


@pytest.mark.parametrize("preset", list(ARCHITECTURES))
def test_a_gpu_preset_loads_from_the_hub_in_its_dtype_and_serves_every_adapter(preset, tmp_path, monkeypatch):
    from lora_manager.space.layout import build_demo

    catalog, _ = load_preset(preset)
    _, _, has_fp16, size = ARCHITECTURES[preset]
    with HubServer(stand_in_hub(preset, tmp_path)) as hub:
        hub_env(monkeypatch, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf_home"))
        with LoraManager.from_preset(preset, compile=False, device="cpu", dtype=catalog.torch_dtype) as m:
            assert m.pipe.dtype == getattr(torch, catalog.torch_dtype)
            fetched = [p.rsplit("/resolve/main/", 1)[-1] for p in hub.paths("GET") if "/resolve/" in p]
            weights = [f for f in fetched if f.endswith(".safetensors") and "/" in f]  # the base model's components
            assert weights and all((".fp16." in f) == has_fp16 for f in weights), weights
            assert {a.id for a in m.adapters()} == {a.id for a in catalog.adapters}, m.stats()
            build_demo(m)
            base = m.generate("a red circle", steps=1, seed=0, output_type="np", **size).image
            for spec in catalog.adapters:
                image = m.generate("a red circle", adapter=spec.id, steps=1, seed=0, output_type="np", **size).image
                assert np.isfinite(image).all() and np.abs(image - base).max() > 0, spec.id
