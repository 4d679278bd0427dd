"""Write many real LoRA files for a pipeline: PEFT-format safetensors (what diffusers' `save_lora_weights` writes,
with each component's LoraConfig in the header) over the pipeline's own module names, one file per `LoraSpec`."""

from __future__ import annotations

from pathlib import Path

import torch

from ..adapters.inspection import ATTENTION, BLOCKS, CONV, TEXT_ATTENTION
from ..testing import lora_config, lora_layers
from .skewed import LoraSpec

FEED_FORWARD = ("ff.net.0.proj", "ff.net.2")
# module-name suffixes per component for each of skewed.TARGET_SETS
TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "attention": {"unet": ATTENTION},
    "attention+ff": {"unet": ATTENTION + FEED_FORWARD},
    "conv": {"unet": CONV},
    "blocks+text": {"unet": BLOCKS, "text_encoder": TEXT_ATTENTION},
}


def write_lora(pipe, spec: LoraSpec, path: Path) -> Path:
    """One PEFT-format file for `spec` over `pipe`'s modules, as `save_lora_weights` writes it; B(A(x)) is about 0.3
    times x, a style-sized delta that keeps images in range."""
    generator = torch.Generator().manual_seed(spec.seed)
    kwargs = {}
    for component, suffixes in TARGETS[spec.targets].items():
        model = getattr(pipe, component)
        layers = lora_layers(model, suffixes, spec.rank, generator, 0.3)
        if not layers:
            raise ValueError(f"no module of {type(model).__name__} ends with any of {suffixes}")
        kwargs[f"{component}_lora_layers"] = layers
        kwargs[f"{component}_lora_adapter_metadata"] = lora_config(layers, spec.rank, spec.alpha)
    type(pipe).save_lora_weights(str(path.parent), weight_name=path.name, **kwargs)
    return path


def write_zoo(pipe, specs: list[LoraSpec], folder: Path) -> dict[str, Path]:
    """Every spec's file in `folder`, by adapter id."""
    folder.mkdir(parents=True, exist_ok=True)
    return {spec.id: write_lora(pipe, spec, folder / f"{spec.id}.safetensors") for spec in specs}
