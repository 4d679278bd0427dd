"""Summaries of adapter files for people: rank, alpha, targets, format, size. Pure functions over AdapterWeights."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .reader import AdapterWeights

ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")  # diffusers' attention projections (UNet, SD3/Flux transformers)
TEXT_ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")  # CLIP text encoders' attention projections
CONV = ("conv1", "conv2")  # the UNet's ResNet convolutions
# attention, feed-forward, the transformer blocks' proj_in/proj_out and the ResNet convs: what most style LoRAs target
BLOCKS = ATTENTION + ("ff.net.0.proj", "ff.net.2", "proj_in", "proj_out") + CONV


def attention_keys(model, component: str) -> set[tuple[str, str]]:
    """A template's modules when no adapter says which: the component's attention projections."""
    return {(component, n) for n, _ in model.named_modules() if n.endswith(ATTENTION)}


def module_kind(module: str) -> str:
    """Group a module path by what it is, for a one-line description of an adapter's targets."""
    leaf = module.rsplit(".", 2)
    name = ".".join(leaf[-2:]) if leaf[-1].isdigit() else leaf[-1]
    kinds = {
        "attention": ATTENTION + TEXT_ATTENTION,
        "feed-forward": ("proj", "net.2", "fc1", "fc2"),
        "proj_in/out": ("proj_in", "proj_out"),
        "conv": ("conv1", "conv2", "conv_shortcut", "conv"),
    }
    return next((k for k, names in kinds.items() if name in names), name)


def summarize(weights: AdapterWeights) -> dict[str, Any]:
    ranks = sorted({m.rank for m in weights.modules.values()})
    alphas = sorted({m.alpha for m in weights.modules.values()})
    targets = Counter(f"{comp}:{module_kind(mod)}" for comp, mod in weights.modules)
    return {
        "format": weights.format,
        "rank": weights.rank,
        "ranks": ranks,
        "alphas": alphas,
        "modules": len(weights.modules),
        "targets": dict(sorted(targets.items())),
        "components": sorted(weights.components),
        "has_text_encoder": weights.has_text_encoder,
        "bytes": weights.nbytes,
    }
