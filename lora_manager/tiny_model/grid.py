"""Labelled grid: the base and every adapter of a catalog on two held-out prompts.

    python -m lora_manager.tiny_model.grid --out lora_manager/presets/tiny/grid.png

One picture that shows at a glance whether the styles differ and the base
follows its prompt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from diffusers import DiffusionPipeline
from PIL import Image, ImageDraw

from . import shapes

CELL = 128  # 64 px images upscaled 2x with NEAREST so the pixels stay crisp
LABEL = 14  # height of the label strip above each cell


def generate(pipe, prompt: str, seed: int, generation: dict, as_uint8: bool = True) -> np.ndarray:
    """One HxWx3 image for a prompt and seed; float [0, 1] when not as_uint8."""
    img = pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **generation).images[0]
    return (img * 255).round().astype(np.uint8) if as_uint8 else img


def save_png(img: np.ndarray, path: Path) -> None:
    Image.fromarray(img).resize((CELL, CELL), Image.NEAREST).save(path, optimize=True)


def make_grid(folder: Path, out: Path, pipe=None) -> None:
    """Rows: two held-out prompts; columns: base, then each adapter with its trigger."""
    catalog = json.loads((folder / "catalog.json").read_text())
    if pipe is None:
        pipe = DiffusionPipeline.from_pretrained(folder / catalog["base_model"], dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
    held = shapes.split_captions()[1]
    prompts = [held[0], held[9]]
    columns = [("base", None, None)] + [(a["id"], a["trigger"], folder / a["source"]) for a in catalog["adapters"]]
    sheet = Image.new("RGB", (CELL * len(columns), (CELL + LABEL) * len(prompts)), "white")
    draw = ImageDraw.Draw(sheet)
    for col, (label, trigger, source) in enumerate(columns):
        if source:
            pipe.load_lora_weights(str(source))
        for row, triple in enumerate(prompts):
            img = generate(pipe, shapes.caption(*triple, trigger), row, catalog["generation"])
            x, y = col * CELL, row * (CELL + LABEL)
            sheet.paste(Image.fromarray(img).resize((CELL, CELL), Image.NEAREST), (x, y + LABEL))
            draw.text((x + 3, y + 1), label, fill="black")
        if source:
            pipe.unload_lora_weights()
    sheet.save(out, optimize=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="PNG path; the catalog is read from its folder")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one thread is fastest when the CPU is shared (see build --threads)
    make_grid(args.out.parent, args.out)


if __name__ == "__main__":
    main()
