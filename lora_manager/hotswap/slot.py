"""One slot of the hotswap template: the model's own LoRA tensors for it, and the in-place swap of an adapter's
weights into them (`LiveSlot`); on CUDA, the side-stream copy that stages the next adapters (`DevicePrefetch`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from ..adapters.reader import AdapterWeights


@dataclass(frozen=True)
class LiveModule:
    """The model's own LoRA tensors for one module: A is [R, in(, kh, kw)], B is [out, R(, 1, 1)]."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: torch.Tensor  # 0-dim; PEFT multiplies B(A(x)) by it


@dataclass(frozen=True)
class SwapPlan:
    """One adapter's writes into the template, paired once so that a swap is a few `_foreach` calls.

    No state_dict builds, string lookups or module walks happen per swap: `dst` are views of the model's own
    tensors (A[:r], B[:, :r]), `ranks` each module's rank r, `scalings` the 0-dim tensors.
    """

    dst: list[torch.Tensor]
    src: list[torch.Tensor]
    ranks: list[tuple[tuple[str, str], int]]
    scalings: list[torch.Tensor]
    scales: list[float]  # alpha / r per module, before strength


class LiveSlot:
    """One slot's template tensors in the model and which adapter they hold. Only the engine's lock holder calls it."""

    def __init__(self, components: dict[str, nn.Module], name: str):
        self.name = name
        self.modules: dict[tuple[str, str], LiveModule] = {}
        for comp, model in components.items():
            for module_name, layer in model.named_modules():
                if isinstance(layer, LoraLayer) and name in layer.lora_A:
                    self.modules[(comp, module_name)] = LiveModule(
                        A=layer.lora_A[name].weight, B=layer.lora_B[name].weight, scaling=_tensor_scaling(layer, name)
                    )
        self.weights: AdapterWeights | None = None
        self.strength = 0.0
        self.loads = 0  # counts `load`s: what was merged from this slot (`fusion`) is stale once it changes
        # per module: how many leading rank rows of A (columns of B) may be nonzero; all above are zero (the template
        # starts zero), so a load zeroes only what the previous adapter wrote above its own rank
        self._filled = dict.fromkeys(self.modules, 0)
        self._plans: dict[int, tuple[AdapterWeights, SwapPlan]] = {}  # by id(weights); the weights keep the id alive

    @property
    def keys(self) -> set[tuple[str, str]]:
        return set(self.modules)

    def plan(self, weights: AdapterWeights, keep: bool = True) -> SwapPlan:
        """The swap plan for `weights`, built on first use and (`keep`) kept while the adapter stays in the CPU
        cache."""
        cached = self._plans.get(id(weights))
        if cached is not None and cached[0] is weights:
            return cached[1]
        dst, src, ranks, scalings, scales = [], [], [], [], []
        for key, m in weights.modules.items():
            live, r = self.modules[key], m.rank
            dst += [live.A[:r], live.B[:, :r]]
            src += [m.A, m.B]
            ranks.append((key, r))
            scalings.append(live.scaling)
            scales.append(m.scale)
        plan = SwapPlan(dst, src, ranks, scalings, scales)
        if keep:
            self._plans[id(weights)] = (weights, plan)
        return plan

    def forget(self, weights: AdapterWeights) -> None:
        """Drop a plan when its adapter leaves the CPU cache, so the cache's byte budget really frees memory."""
        self._plans.pop(id(weights), None)

    @torch.no_grad()
    def load(self, weights: AdapterWeights | None, strength: float, staged: AdapterWeights | None = None) -> None:
        """Write `weights` (None: no adapter) into the template in place. `staged` is a device copy of `weights`
        (`DevicePrefetch`): the copy is then device to device. Host-to-device copies are issued non-blocking: the
        caller waits once for all the slots it loads (`sync`)."""
        old = self.weights.modules if self.weights else {}
        new = weights.modules if weights else {}
        plan = None if weights is None else self.plan(staged, keep=False) if staged is not None else self.plan(weights)
        stale = old.keys() - new.keys()  # used by the old adapter, not by the new one: cleared, with its scaling
        zero = [self.modules[k].scaling for k in stale]
        for key, rank in [*((k, 0) for k in stale), *(plan.ranks if plan else [])]:
            zero += self._clear(key, rank)
        if zero:  # before the copy: on CUDA it may cover the copied rows too
            torch._foreach_zero_(zero)
        self.loads += 1
        if plan is not None:
            torch._foreach_copy_(plan.dst, plan.src, non_blocking=True)
        self.weights = weights
        self.set_strength(strength)

    @torch.no_grad()
    def clear(self) -> None:
        """Zero every tensor of the slot, whatever a write that failed part way left there: it then holds nothing."""
        torch._foreach_zero_([t for m in self.modules.values() for t in (m.A, m.B, m.scaling)])
        self._filled = dict.fromkeys(self.modules, 0)
        self.weights, self.strength = None, 0.0
        self.loads += 1

    def _clear(self, key: tuple[str, str], rank: int) -> list[torch.Tensor]:
        """What to zero at one module before an adapter of `rank` is written there: what the last one wrote above
        that rank (stale rows of a larger adapter would leak in). CUDA: the whole dense tensors (one fused kernel
        each) rather than two strided views."""
        live, filled = self.modules[key], self._filled[key]
        self._filled[key] = rank
        if filled <= rank:
            return []
        return [live.A, live.B] if live.A.is_cuda else [live.A[rank:filled], live.B[:, rank:filled]]

    @torch.no_grad()
    def set_strength(self, strength: float) -> None:
        """Rescale the live adapter in place (scaling = alpha / r * strength): no recompile."""
        if self.weights is not None:
            plan = self.plan(self.weights)
            torch._foreach_zero_(plan.scalings)
            torch._foreach_add_(plan.scalings, [s * strength for s in plan.scales])
        self.strength = strength


class DevicePrefetch:
    """CUDA only: copies the adapters the next batch will likely need host-to-device on a side stream while the
    current batch runs, so the swap between batches is a device-to-device copy. Only the engine's lock holder calls
    it; at most `limit` adapters are staged."""

    def __init__(self, device: torch.device, limit: int):
        self.device = device
        self.limit = limit
        self.stream = torch.cuda.Stream(device)
        self._staged: dict[str, tuple[AdapterWeights, AdapterWeights, torch.cuda.Event]] = {}

    @torch.no_grad()
    def stage(self, wanted: dict[str, AdapterWeights]) -> None:
        """Start copying `wanted` (adapter id -> its CPU-cache entry, page-locked) and drop staged copies not wanted."""
        for adapter_id in [a for a in self._staged if a not in wanted]:
            del self._staged[adapter_id]
        for adapter_id, weights in list(wanted.items())[: self.limit]:
            held = self._staged.get(adapter_id)
            if held is not None and held[0] is weights:
                continue
            with torch.cuda.stream(self.stream):
                copy = AdapterWeights(
                    {
                        k: replace(
                            m, A=m.A.to(self.device, non_blocking=True), B=m.B.to(self.device, non_blocking=True)
                        )
                        for k, m in weights.modules.items()
                    },
                    format=weights.format,
                    folded_alpha=weights.folded_alpha,
                )
                done = torch.cuda.Event()
                done.record(self.stream)
            self._staged[adapter_id] = (weights, copy, done)

    def take(self, adapter_id: str, weights: AdapterWeights) -> AdapterWeights | None:
        """The staged device copy of exactly `weights` (None if none), ordered after its host-to-device copy."""
        held = self._staged.pop(adapter_id, None)
        if held is None or held[0] is not weights:
            return None
        current = torch.cuda.current_stream(self.device)
        current.wait_event(held[2])
        for m in held[1].modules.values():  # allocated on the side stream, read on this one
            m.A.record_stream(current)
            m.B.record_stream(current)
        return held[1]


def _tensor_scaling(layer: LoraLayer, name: str) -> torch.Tensor:
    """PEFT keeps scaling as a float unless prepared for hotswap; a tensor lets swaps change it in place."""
    value = layer.scaling[name]
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(float(value), device=layer.lora_A[name].weight.device)
        layer.scaling[name] = value
    return value


def sync(device: torch.device) -> None:
    """Wait for non_blocking host-to-device copies, so a swap's time and effect are complete: once per swap, however
    many slots it loaded."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
