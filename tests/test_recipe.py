"""The README's plain-diffusers recipe, run exactly as a reader copies it: the ```python block under "## Plain
diffusers recipe", as a script of its own, with only its first assignments replaced. On the shipped tiny preset with
its six LoRAs (the conv-only one first, narrower than the rest) and on mini SDXL and mini Flux pipelines saved as
folders, each with LoRA files in several formats of which none targets every module the others do, text-encoder parts
included. The recipe compiles the denoiser and swaps under `error_on_recompile`; every image it writes must equal,
within 2 levels of 255, a fresh pipeline that did `load_lora_weights(file)`."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image
from safetensors.torch import load_file, save_file

from lora_manager.bench.mini_pipelines import mini_flux, mini_sdxl

from helpers import ROOT
from lora_formats import flux_files, sdxl_files

pytestmark = pytest.mark.compile
HEADING = "## Plain diffusers recipe"
SETTINGS = ("MODEL", "LORAS", "PROMPT", "SEED", "STEPS", "SIZE", "OUT")
TINY = ROOT / "lora_manager" / "presets" / "tiny"
# formats per mini architecture, a narrow one first; between them no file covers every module the others target
PICKS = {
    "sdxl": ("kohya_sgm_attn", "kohya_diffusers_names_te1", "peft_meta_te12", "diffusers_old"),
    "flux": ("xlabs", "peft_meta_te", "kohya_te", "comfyui_te"),
}


def recipe() -> str:
    section = (ROOT / "README.md").read_text().split(f"\n{HEADING}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_recipe_is_self_contained_and_starts_with_its_settings():
    tree = ast.parse(recipe())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"pathlib", "re", "torch", "diffusers", "peft"}, imported
    assigned = [
        node.targets[0].id
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    ]
    assert tuple(assigned[: len(SETTINGS)]) == SETTINGS, assigned


def settings_of(code: str) -> dict:
    """The recipe's settings as it runs them: its statements up to the OUT assignment, executed from the repo root."""
    tree = ast.parse(code)
    last = next(
        i
        for i, node in enumerate(tree.body)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "OUT"
    )
    namespace: dict = {}
    exec(compile(ast.Module(body=tree.body[: last + 1], type_ignores=[]), "recipe", "exec"), namespace)
    resolve = lambda p: str(p if Path(p).is_absolute() or not (ROOT / p).exists() else ROOT / p)  # noqa: E731
    return {
        "MODEL": resolve(namespace["MODEL"]),
        "LORAS": [resolve(p) for p in namespace["LORAS"]],
        **{k: namespace[k] for k in ("PROMPT", "SEED", "STEPS", "SIZE", "OUT")},
    }


def run_recipe(tmp_path: Path, **settings) -> dict:
    """The recipe as a script with `settings` replacing its assignments, run from the repo root; returns the settings
    it ran with."""
    code, done = recipe_process(tmp_path, **settings)
    assert done.returncode == 0, done.stderr[-4000:]
    return settings_of(code)


def recipe_process(tmp_path: Path, **settings) -> tuple[str, subprocess.CompletedProcess]:
    code = recipe()
    lines = code.splitlines()
    for node in reversed(ast.parse(code).body):  # from the end, so earlier line numbers stay valid
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in settings:
            lines[node.lineno - 1 : node.end_lineno] = [f"{node.targets[0].id} = {settings[node.targets[0].id]!r}"]
    code = "\n".join(lines) + "\n"
    script = tmp_path / "recipe.py"
    script.write_text(code)
    return code, subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=1200)


def reference(ran: dict, lora: str | None) -> np.ndarray:
    """A fresh pipeline with only that LoRA (None: none), loaded the ordinary way, the recipe's call otherwise."""
    pipe = DiffusionPipeline.from_pretrained(ran["MODEL"])
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()  # PEFT adds lora_dropout modules in training mode
    generator = torch.Generator("cpu").manual_seed(ran["SEED"])
    image = pipe(
        ran["PROMPT"], num_inference_steps=ran["STEPS"], height=ran["SIZE"], width=ran["SIZE"], generator=generator
    ).images[0]
    return np.asarray(image, dtype=int)


def check_images(ran: dict) -> None:
    made = {
        lora: np.asarray(Image.open(Path(ran["OUT"]) / f"{Path(lora).stem}.png"), dtype=int) for lora in ran["LORAS"]
    }
    for lora, image in made.items():
        assert np.abs(image - reference(ran, lora)).max() <= 2, lora
    base = reference(ran, None)
    assert any(np.abs(image - base).mean() > 1 for image in made.values())  # the LoRAs change the image


def test_the_recipe_as_written_on_the_tiny_preset(tmp_path):
    ran = run_recipe(tmp_path, OUT=str(tmp_path / "out"))
    assert Path(ran["MODEL"]).resolve() == (TINY / "model").resolve()
    assert sorted(Path(p).name for p in ran["LORAS"]) == sorted(p.name for p in (TINY / "adapters").iterdir())
    assert Path(ran["LORAS"][0]).stem == "outline"  # conv only: narrower than every LoRA after it
    check_images(ran)


@pytest.mark.parametrize("arch", ["sdxl", "flux"])
def test_the_recipe_on_mini_sdxl_and_flux_with_several_formats(tmp_path, arch):
    pipe = {"sdxl": mini_sdxl, "flux": mini_flux}[arch]()
    model = tmp_path / "model"
    pipe.save_pretrained(model)
    files = {"sdxl": sdxl_files, "flux": flux_files}[arch](pipe, tmp_path)
    picked = [files[name] for name in PICKS[arch]]
    denoiser = "unet" if arch == "sdxl" else "transformer"
    union = set().union(*(f.targets for f in picked))
    assert not any({t for t in union if t[0] == denoiser} <= f.targets for f in picked)  # no file covers the rest
    assert any(f.has_text_encoder for f in picked)
    ran = run_recipe(
        tmp_path,
        MODEL=str(model),
        LORAS=[str(f.path) for f in picked],
        PROMPT="a red circle",
        SEED=3,
        STEPS=2,
        SIZE=32,
        OUT=str(tmp_path / "out"),
    )
    check_images(ran)


@pytest.mark.parametrize("kind", ["dora", "bias"])
def test_the_recipe_refuses_dora_and_lora_bias_files_by_name(tmp_path, kind):
    """A and B alone would make such a file silently wrong: the recipe stops, naming the file."""
    sd = load_file(TINY / "adapters" / "stripes.safetensors")
    key = next(k for k in sd if "to_q.lora_B" in k)
    extra = key.replace("lora_B.weight", "lora_magnitude_vector") if kind == "dora" else key.replace("weight", "bias")
    sd[extra] = torch.ones(sd[key].shape[0])
    path = tmp_path / f"{kind}.safetensors"
    save_file(sd, path)
    _, done = recipe_process(tmp_path, LORAS=[str(TINY / "adapters" / "dots.safetensors"), str(path)])
    assert done.returncode == 1
    assert f"ValueError: {path}: DoRA or LoRA bias in " in done.stderr
