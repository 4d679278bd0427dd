"""The one-adapter path at the base model's speed: a pipeline call whose rows all run the same adapters at the same
strengths (or none) runs the base weights with those adapters merged in, and no LoRA branch at all.

Every template layer's forward first reads one switch (`FusionSwitch.on`): on, it is the base layer alone; off, the
LoRA forward as before (PEFT's, or the gathered one of mixed batches). A compiled denoiser guards on the switch, so it
keeps one graph for each value, both made at warm-up: switching is never a recompile. Before a merge first writes a
layer's weight, that weight is copied once, untouched (`pristine`); the merge writes pristine + sum of
B @ A x scale x strength into the weight in place (in float32, rounded once), and a restore copies the pristine
weight back and drops the copy, so the base is bit-identical after any sequence of merges, swaps, strength changes
and failures (never an unmerge by subtraction, which drifts in half precision). The copies of the layers merged now
are what the path costs in memory (`report`): an adapter on the attention layers alone copies only those.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from .slot import LiveSlot

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (component, module path)
Picks = tuple[tuple[int, float], ...]  # (device slot, strength factor) of the adapters merged in


@dataclass
class FusionSwitch:
    """Read by every template layer's forward: on, the layer runs its base weights only."""

    on: bool = False


def unsupported(layers: dict[Key, LoraLayer]) -> str | None:
    """Why these template layers cannot run merged (None: they can): a merge is B @ A added to a plain linear or
    convolution weight, which PEFT's LoRA of that layer equals."""
    for (comp, module), layer in layers.items():
        base = layer.get_base_layer()
        if type(base) not in (nn.Linear, nn.Conv2d) or getattr(layer, "fan_in_fan_out", False):
            return f"{comp}.{module} is a {type(base).__name__}, not a plain Linear or Conv2d"
        if isinstance(base, nn.Conv2d) and (base.groups != 1 or any(d != 1 for d in base.dilation)):
            return f"{comp}.{module} is a grouped or dilated convolution"
    return None


class Fusion:
    """Merges one call's adapters into the base weights of the template layers, and restores them exactly. Owned by
    `Residency`; only the engine's lock holder calls it."""

    def __init__(self, components: dict[str, nn.Module], slots: list[LiveSlot]):
        self.switch = FusionSwitch()
        self._slots = slots
        layers = {k: _layer(components, k) for k in slots[0].modules}
        self.weights = {k: layer.get_base_layer().weight for k, layer in layers.items()}
        # the base weight of every layer a merge may have written; a layer not here holds its base weight
        self._pristine: dict[Key, torch.Tensor] = {}
        self._merged: tuple | None = None  # what the weights hold now (None: the pristine base)
        self.merges = self.failures = 0
        for layer in layers.values():
            layer.forward = _switched(layer.get_base_layer(), layer.forward, self.switch)

    def report(self) -> dict[str, Any]:
        """The fused path's part of the engine's `stats()`: whether the last call ran merged, and its memory."""
        return {
            "fused": self.switch.on,
            "fused_bytes": sum(t.numel() * t.element_size() for t in self._pristine.values()),
            "fused_merges": self.merges,
            "fused_failures": self.failures,
        }

    def run(self, picks: Picks | None) -> None:
        """Before a pipeline call: `picks` are the (device slot, strength factor) every row runs, merged into the
        base weights (() for none: the base itself); None when rows differ, which runs the LoRA forward over the base.
        A merge that fails part way restores the base and runs the call unmerged (logged, counted)."""
        if picks is None:
            self.switch.on = False
            self._restore()
            return
        state = tuple((i, self._slots[i].loads, self._slots[i].strength, f) for i, f in picks)
        if state != self._merged:
            try:
                self._merge(picks)
            except Exception:  # noqa: BLE001 - the unmerged forward gives the same images
                log.warning("merging the adapters into the base weights failed; running unmerged", exc_info=True)
                self.failures += 1
                self.switch.on = False
                self._restore()
                return
            self._merged = state
        self.switch.on = True

    @torch.no_grad()
    def _merge(self, picks: Picks) -> None:
        """Each layer's weight := pristine + sum over picks of B @ A x scale x strength (float32, rounded once);
        layers no pick targets get their pristine weight back."""
        self._merged = None  # until every layer is written
        targeted: set[Key] = set()
        for i, _ in picks:
            held = self._slots[i].weights
            targeted |= held.modules.keys() if held is not None else set()
        for key in self._pristine.keys() - targeted:
            self.weights[key].copy_(self._pristine[key])
            del self._pristine[key]
        for key in targeted:
            weight = self.weights[key]
            if key not in self._pristine:
                self._pristine[key] = weight.detach().clone()
            pristine = self._pristine[key]
            total = pristine.to(torch.float32, copy=True).view(pristine.shape[0], -1)
            for i, factor in picks:
                slot = self._slots[i]
                module = slot.weights.modules.get(key) if slot.weights is not None else None
                if module is None or factor == 0:
                    continue
                live, r = slot.modules[key], module.rank
                B, A = live.B.flatten(1)[:, :r].to(torch.float32), live.A.flatten(1)[:r].to(torch.float32)
                total.addmm_(B, A, alpha=module.scale * slot.strength * factor)
            weight.copy_(total.view(weight.shape))
        self.merges += 1

    @torch.no_grad()
    def _restore(self) -> None:
        """Every changed weight back to its pristine copy, bit for bit; the copies are then dropped."""
        self._merged = None
        for key in list(self._pristine):
            self.weights[key].copy_(self._pristine[key])
            del self._pristine[key]


def _switched(base: nn.Module, lora_forward, switch: FusionSwitch):
    """A template layer's forward: its base layer alone while the switch is on, else its LoRA forward."""

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if switch.on:
            return base(x, *args, **kwargs)
        return lora_forward(x, *args, **kwargs)

    forward.__wrapped__ = lora_forward  # `inspect.unwrap` finds the LoRA forward
    forward.fusion_switch = switch
    return forward


def switch_of(layer: nn.Module) -> FusionSwitch | None:
    """The switch a template layer's forward reads (None: the layer is not under a `Fusion`)."""
    return getattr(layer.forward, "fusion_switch", None)


def _layer(components: dict[str, nn.Module], key: Key) -> LoraLayer:
    comp, module = key
    return components[comp].get_submodule(module)
