"""Every LoRA file family diffusers reads, on each architecture the presets run: SD 1.5 (the tiny model), SDXL and
Flux (mini stand-ins with the real block layouts). Each architecture gets one engine, started like a preset (a
catalog.json naming a base-model folder and local adapter files), that must serve every file as plain diffusers'
`load_lora_weights` does, report what the file says, and refuse what diffusers cannot read with the reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import save_file

from lora_manager import AdapterFormatError, LoraManager
from lora_manager.adapters.reader import read_adapter
from lora_manager.bench.mini_pipelines import FLUX_GEN, SDXL_GEN, mini_flux, mini_sdxl
from lora_manager.testing import rewrite

from engine_helpers import assert_same_image, load_tiny, served
from helpers import GEN, PROMPT, ROOT, TINY_MODEL
from lora_formats import (
    FLUX_SINGLE,
    FLUX_SINGLE_LINEAR1,
    SD_ATTN,
    LoraFile,
    ends_with,
    flux_files,
    flux_fused,
    random_lora,
    sd15_files,
    sdxl_files,
    write_flux_kohya,
    write_peft_alpha_tensors,
)


@dataclass(frozen=True)
class Arch:
    build: Callable[[], DiffusionPipeline]  # the base pipeline, same random weights on every call
    generation: dict
    write: Callable[[DiffusionPipeline, Path], dict[str, LoraFile]]
    shipped: Path | None = None  # a base model already on disk (the tiny preset's), else saved from `build`


ARCHS = {
    "sd15": Arch(load_tiny, GEN, sd15_files, shipped=TINY_MODEL),
    "sdxl": Arch(mini_sdxl, SDXL_GEN, sdxl_files),
    "flux": Arch(mini_flux, FLUX_GEN, flux_files),
}


class Preset:
    """One architecture as a preset folder: model/, adapters/*.safetensors, catalog.json with relative paths."""

    def __init__(self, name: str, root: Path):
        arch = ARCHS[name]
        self.generation = arch.generation
        pipe = arch.build()
        self.base = arch.shipped or root / "model"
        if arch.shipped is None:
            pipe.save_pretrained(self.base)
        (root / "adapters").mkdir()
        self.files = arch.write(pipe, root / "adapters")
        self.catalog = root / "catalog.json"
        self.catalog.write_text(
            json.dumps(
                {
                    "name": f"{name}-formats",
                    "base_model": str(self.base.relative_to(root)) if arch.shipped is None else str(self.base),
                    "generation": self.generation,
                    "adapters": [{"id": i, "source": str(f.path.relative_to(root))} for i, f in self.files.items()],
                }
            )
        )
        self._references: dict[str | None, np.ndarray] = {}

    @cached_property
    def engine(self) -> LoraManager:
        """The one eager engine of this architecture, started the way `from_preset` starts a GPU preset."""
        return LoraManager.from_preset(str(self.catalog), compile=False, device="cpu")

    def fresh(self) -> DiffusionPipeline:
        pipe = DiffusionPipeline.from_pretrained(self.base, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference(self, adapter: str | None) -> np.ndarray:
        """A fresh plain-diffusers pipeline that loaded only this file with `load_lora_weights`."""
        if adapter not in self._references:
            pipe = self.fresh()
            if adapter is not None:
                path = self.files[adapter].path
                pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name="ref")
                for name in pipe._lora_loadable_modules:  # PEFT's lora_dropout modules start in training mode
                    getattr(pipe, name).eval()
            gen = torch.Generator("cpu").manual_seed(0)
            self._references[adapter] = pipe(PROMPT, generator=gen, output_type="np", **self.generation).images[0]
        return self._references[adapter]


@pytest.fixture(scope="module")
def presets(tmp_path_factory) -> Iterator[Callable[[str], Preset]]:
    """Each architecture's preset folder and engine, made on first use and shared by every test of this module."""
    made: dict[str, Preset] = {}

    def get(name: str) -> Preset:
        if name not in made:
            made[name] = Preset(name, tmp_path_factory.mktemp(name))
        return made[name]

    yield get
    for preset in made.values():
        if "engine" in preset.__dict__:
            preset.engine.close()


def mixed_and_back(names: list[str]) -> list[str | None]:
    """Files alternately from both ends of the list, "no adapter" halfway, then the same steps in reverse."""
    order = [names[i // 2] if i % 2 == 0 else names[-1 - i // 2] for i in range(len(names))]
    steps = order[: len(order) // 2] + [None] + order[len(order) // 2 :]
    return steps + steps[::-1]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_family_is_served_like_plain_diffusers(arch, presets):
    preset = presets(arch)
    engine = preset.engine
    assert engine.refused == {} and {a.id for a in engine.adapters()} == set(preset.files)
    base = preset.reference(None)
    for name in preset.files:  # every file really changes the image, so a file served as a no-op cannot pass
        assert np.abs(preset.reference(name) - base).max() > 0.02, name
    for adapter in mixed_and_back(list(preset.files)):
        assert_same_image(served(engine, adapter), preset.reference(adapter))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_reported_rank_alpha_text_encoder_format_and_targets_match_the_file(arch, presets):
    preset = presets(arch)
    engine = preset.engine
    assert engine.target_rank == max(f.rank for f in preset.files.values())
    for name, f in preset.files.items():
        info = engine.info(name)
        assert (info.format, info.rank, info.has_text_encoder) == (f.family, f.rank, f.has_text_encoder), name
        assert info.alpha == pytest.approx(f.alpha), name
        weights = read_adapter(f.path, name, type(engine.pipe), engine.components, torch.float32)
        assert set(weights.modules) == f.targets, name
        assert info.num_modules == len(f.targets), name


def _peft_with_alpha_tensors(pipe, path: Path) -> Path:
    write_peft_alpha_tensors(
        path, {"unet": random_lora(pipe.unet, ends_with(*SD_ATTN), 4, seed=50)}, lambda comp, m: 2.0
    )
    return path


def _flux_kohya_with_linear1(pipe, path: Path) -> Path:
    fused = flux_fused(pipe.transformer, 4, seed=51, single=FLUX_SINGLE + (FLUX_SINGLE_LINEAR1,))
    write_flux_kohya(path, fused, alpha=4)
    return path


def _alpha_tensors_and_metadata(pipe, path: Path) -> Path:
    src = path.with_name("src.safetensors")
    write_peft_alpha_tensors(
        src, {"transformer": random_lora(pipe.transformer, ends_with("attn.to_q"), 4, seed=52)}, lambda comp, m: 2.0
    )
    meta = {"transformer.r": 4, "transformer.lora_alpha": 2, "transformer.target_modules": ["to_q"]}
    return rewrite(src, path, lambda t, m: m.update(lora_adapter_metadata=json.dumps(meta)))


def _unet_checkpoint(pipe, path: Path) -> Path:
    save_file(pipe.unet.conv_in.state_dict(prefix="conv_in."), str(path))
    return path


ALPHA_BESIDE_PEFT = r"unet\..*\.alpha is not a LoRA A/B weight: .* re-save it with alpha in the metadata"
# (architecture, writer, what the engine's message must say); plain diffusers refuses each of these files too.
REFUSED = {
    "sdxl a UNet checkpoint, not a LoRA": ("sdxl", _unet_checkpoint, r"no LoRA weights in bad\.safetensors .*conv_in"),
    "sd15 PEFT keys with .alpha tensors": ("sd15", _peft_with_alpha_tensors, ALPHA_BESIDE_PEFT),
    "sdxl PEFT keys with .alpha tensors": ("sdxl", _peft_with_alpha_tensors, ALPHA_BESIDE_PEFT),
    "flux kohya fused linear1 of another size": (
        "flux",
        _flux_kohya_with_linear1,
        r"AssertionError \(no message\) in diffusers' _convert_to_ai_toolkit_cat",
    ),
    "flux alpha tensors and metadata": ("flux", _alpha_tensors_and_metadata, r"both \.alpha tensors and"),
}
INVALID = "Invalid LoRA checkpoint. Make sure all LoRA param names contain `'lora'` substring."
# what plain diffusers raises on each of them: its own ValueError, or (the fused linear1) an assert without a message
DIFFUSERS_RAISES = {
    "sdxl a UNet checkpoint, not a LoRA": (ValueError, re.escape(INVALID)),
    "sd15 PEFT keys with .alpha tensors": (ValueError, re.escape(INVALID)),
    "sdxl PEFT keys with .alpha tensors": (ValueError, re.escape(INVALID)),
    "flux kohya fused linear1 of another size": (AssertionError, r"^$"),
    "flux alpha tensors and metadata": (ValueError, r"Both `network_alphas` and `metadata` cannot be specified"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_files_diffusers_cannot_read_are_refused_with_the_reason(case, presets, tmp_path):
    arch, write, says = REFUSED[case]
    preset = presets(arch)
    path = write(preset.fresh(), tmp_path / "bad.safetensors")
    kind, says_diffusers = DIFFUSERS_RAISES[case]
    with pytest.raises(kind, match=says_diffusers):
        preset.fresh().load_lora_weights(str(tmp_path), weight_name=path.name)
    with pytest.raises(AdapterFormatError, match=says) as refused:
        preset.engine.register("bad", str(path))
    text = str(refused.value)
    assert text.startswith("Adapter 'bad'") and "()" not in text and refused.value.adapter_id == "bad"
    assert "bad" not in {a.id for a in preset.engine.adapters()}


@pytest.mark.compile
def test_compiled_flux_serves_every_family_without_recompiling(presets, tmp_path):
    preset = presets("flux")
    steps = mixed_and_back(list(preset.files))
    out = tmp_path / "compiled.npz"
    code = (
        f"from engine_helpers import serve_compiled; serve_compiled({str(preset.catalog)!r}, {steps!r}, {str(out)!r})"
    )
    paths = os.pathsep.join([str(ROOT), str(ROOT / "tests")])  # what pyproject's pytest `pythonpath` gives this process
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": paths},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]  # a recompile raises RecompileError there
    result = np.load(out)
    assert result["compiled"] and result["recompiles"] == 0 and result["swaps"] >= 2 * len(preset.files)
    for adapter, image in zip(steps, result["images"], strict=True):
        assert_same_image(image, preset.reference(adapter))
