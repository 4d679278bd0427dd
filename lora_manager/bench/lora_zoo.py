"""Write many real LoRA files for a pipeline: PEFT-format safetensors (what diffusers' `save_lora_weights` writes,
with each component's LoraConfig in the header) over the pipeline's own module names, one file per `LoraSpec`."""

from __future__ import annotations

from pathlib import Path

import torch

from ..adapters.inspection import ATTENTION, BLOCKS, CONV, TEXT_ATTENTION
from ..adapters.validate import lora_shapes
from .skewed import LoraSpec

FEED_FORWARD = ("ff.net.0.proj", "ff.net.2")
# module-name suffixes per component for each of skewed.TARGET_SETS
TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "attention": {"unet": ATTENTION},
    "attention+ff": {"unet": ATTENTION + FEED_FORWARD},
    "conv": {"unet": CONV},
    "blocks+text": {"unet": BLOCKS, "text_encoder": TEXT_ATTENTION},
}


def random_lora(model: torch.nn.Module, suffixes: tuple[str, ...], rank: int, generator: torch.Generator) -> dict:
    """Random A/B for every Linear/Conv2d whose name ends with one of `suffixes`; B(A(x)) is about 0.3 times x, a
    style-sized delta that keeps images in range."""
    weights = {}
    for name, layer in model.named_modules():
        if name.endswith(suffixes) and isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            a_shape, b_shape = lora_shapes(layer, rank)
            fan_in = a_shape[1] * (a_shape[2] * a_shape[3] if len(a_shape) == 4 else 1)
            weights[f"{name}.lora_A.weight"] = torch.randn(a_shape, generator=generator) / fan_in**0.5
            weights[f"{name}.lora_B.weight"] = torch.randn(b_shape, generator=generator) * 0.3 / rank**0.5
    if not weights:
        raise ValueError(f"no module of {type(model).__name__} ends with any of {suffixes}")
    return weights


def write_lora(pipe, spec: LoraSpec, path: Path) -> Path:
    """One PEFT-format file for `spec` over `pipe`'s modules, as `save_lora_weights` writes it."""
    generator = torch.Generator().manual_seed(spec.seed)
    kwargs = {}
    for component, suffixes in TARGETS[spec.targets].items():
        layers = random_lora(getattr(pipe, component), suffixes, spec.rank, generator)
        modules = sorted(k.removesuffix(".lora_A.weight") for k in layers if k.endswith(".lora_A.weight"))
        kwargs[f"{component}_lora_layers"] = layers
        kwargs[f"{component}_lora_adapter_metadata"] = {
            "r": spec.rank,
            "lora_alpha": spec.alpha,
            "target_modules": modules,
        }
    type(pipe).save_lora_weights(str(path.parent), weight_name=path.name, **kwargs)
    return path


def write_zoo(pipe, specs: list[LoraSpec], folder: Path) -> dict[str, Path]:
    """Every spec's file in `folder`, by adapter id."""
    folder.mkdir(parents=True, exist_ok=True)
    return {spec.id: write_lora(pipe, spec, folder / f"{spec.id}.safetensors") for spec in specs}
