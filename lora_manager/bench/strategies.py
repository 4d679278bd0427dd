"""Measure the ways of serving many LoRAs on one denoiser, side by side, on the same adapters.

Shared by `python -m lora_manager bench`, the app's Strategies tab and the tutorial notebook. Every function works
on a denoiser the caller made fresh for it, never on one a `LoraManager` owns (they write into its LoRA tensors, and
would corrupt the live template). Timings are milliseconds: the median over `repeats`, with the raw samples.

`loader` is a diffusers LoRA loader class (e.g. `StableDiffusionLoraLoaderMixin`): its `lora_state_dict` and
`load_lora_into_unet` are exactly what `pipe.load_lora_weights(...)` runs for the denoiser, without a pipeline.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch import nn
from torch._dynamo.utils import counters

from ..adapters.reader import AdapterWeights
from ..hotswap.slot import LiveSlot, sync
from ..hotswap.template import compile_denoiser, prepare_template

NAME = "bench"  # the adapter name the plain-diffusers strategies load under
Inputs = dict[str, Any]  # keyword arguments of the denoiser call


@dataclass(frozen=True)
class Timing:
    median_ms: float
    samples_ms: tuple[float, ...]


@dataclass(frozen=True)
class BenchAdapter:
    """One denoiser-only adapter in the forms the strategies need: its file and the engine's converted weights."""

    name: str
    path: Path  # pipeline layout ("unet." keys), alpha in diffusers' metadata or kohya `.alpha` tensors
    weights: AdapterWeights  # keyed ("unet", module path)

    @property
    def rank(self) -> int:
        return self.weights.rank

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter as a cached in-memory dict, as a plain-diffusers server would keep it."""
        sd = {}
        for (_, module), m in self.weights.modules.items():
            sd[f"{module}.lora_A.weight"] = m.A
            sd[f"{module}.lora_B.weight"] = m.B
        return sd

    def lora_config(self) -> dict:
        """The LoraConfig kwargs to pass as `metadata=`: without them a dict load scales by 1 instead of alpha / r."""
        ranks = {m.rank for m in self.weights.modules.values()}
        alphas = {m.alpha for m in self.weights.modules.values()}
        if len(ranks) > 1 or len(alphas) > 1:
            raise ValueError(f"{self.name}: per-module ranks or alphas need rank/alpha patterns; use a uniform one")
        modules = sorted(module for _, module in self.weights.modules)
        return {"r": ranks.pop(), "lora_alpha": alphas.pop(), "target_modules": modules}


@dataclass(frozen=True)
class Floors:
    flat: Timing  # one copy_ of the adapter's bytes, buffer to buffer
    per_tensor: Timing  # copy_ tensor by tensor into the model's own LoRA views A[:r], B[:, :r]


@dataclass(frozen=True)
class Hotswap:
    from_file: Timing  # load_lora_weights(file, adapter_name=same, hotswap=True)
    from_dict: Timing  # load_lora_adapter(cached dict, metadata=config, hotswap=True)


@dataclass(frozen=True)
class Reload:
    delete_load: Timing  # delete_adapters + load_lora_weights(file)
    unload_load: Timing  # unload_lora + load_lora_weights(file)
    read_file: Timing  # lora_state_dict(file) alone: what every reload reads, and the engine only on a cache miss


@dataclass(frozen=True)
class Resident:
    counts: tuple[int, ...]
    set_adapters: tuple[Timing, ...]  # set_adapters(all, [1, 0, 0, ...]) with N resident
    forward: tuple[Timing, ...] | None  # denoiser call with N resident; None when not measured


@dataclass(frozen=True)
class Slots:
    counts: tuple[int, ...]
    base_forward: Timing  # the denoiser without any LoRA layers
    forward: tuple[Timing, ...]  # denoiser call with K slots, each holding an adapter


@dataclass(frozen=True)
class Compiled:
    compile_s: float  # first compiled call
    swaps: int
    recompiles: int  # dynamo unique_graphs added by the swaps
    max_abs_diff_vs_eager: float  # compiled vs eager output after the last swap


def timed(fn: Callable[[int], object], repeats: int, device: torch.device, warmup: int = 1) -> Timing:
    """Call fn(i) `warmup` times untimed, then `repeats` times timed, each call bracketed by a device sync."""
    for i in range(warmup):
        fn(i)
    samples = []
    for i in range(warmup, warmup + repeats):
        sync(device)
        t0 = time.perf_counter()
        fn(i)
        sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(samples), tuple(samples))


def device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def forward(unet: nn.Module, inputs: Inputs) -> torch.Tensor:
    return unet(**inputs).sample


def timed_forward(unet: nn.Module, inputs: Inputs, repeats: int) -> Timing:
    """`timed` over forwards of `unet` on `inputs`, on the device its parameters live on."""
    return timed(lambda _: forward(unet, inputs), repeats, device_of(unet))


# ---- the engine ---------------------------------------------------------------------------------------------------


def prepare_engine(unet: nn.Module, modules: set[str], rank: int, slots: int = 1) -> list[LiveSlot]:
    """The engine's preparation (`prepare_template`) on a bare denoiser: enable hotswap, one zero template over
    `modules` per slot, all of them active."""
    return prepare_template(unet, {"unet": unet}, {("unet", m) for m in modules}, rank, slots)


def measure_engine_swap(slot: LiveSlot, weights: list[AdapterWeights], repeats: int) -> Timing:
    """`LiveSlot.load` cycling through `weights` (plans built in the warm-up, as after a first request each)."""
    device = next(iter(slot.modules.values())).A.device
    return timed(lambda i: slot.load(weights[i % len(weights)], 1.0), repeats, device, warmup=len(weights))


def measure_floors(slot: LiveSlot, weights: list[AdapterWeights], repeats: int) -> Floors:
    """What moving the same bytes costs at least: as one buffer, and tensor by tensor into the model's views."""
    device = next(iter(slot.modules.values())).A.device
    pin = device.type == "cuda"
    srcs = [torch.empty(w.nbytes, dtype=torch.uint8, pin_memory=pin) for w in weights]
    dst = torch.empty(max(w.nbytes for w in weights), dtype=torch.uint8, device=device)

    def flat(i: int) -> None:
        src = srcs[i % len(srcs)]
        dst[: src.numel()].copy_(src, non_blocking=pin)

    pairs = [_copy_pairs(slot, w) for w in weights]

    def per_tensor(i: int) -> None:
        with torch.no_grad():
            for d, s in pairs[i % len(pairs)]:
                d.copy_(s, non_blocking=pin)

    return Floors(
        flat=timed(flat, repeats, device, warmup=len(weights)),
        per_tensor=timed(per_tensor, repeats, device, warmup=len(weights)),
    )


# ---- plain diffusers ----------------------------------------------------------------------------------------------


def load_file(unet: nn.Module, loader: type, path: Path, adapter_name: str, hotswap: bool = False) -> None:
    """`pipe.load_lora_weights(path, adapter_name=..., hotswap=...)` for the denoiser: read the file, convert, load."""
    sd, alphas, metadata = loader.lora_state_dict(
        str(path.parent), weight_name=path.name, use_safetensors=True, return_lora_metadata=True
    )
    # low_cpu_mem_usage=True is load_lora_weights' default on these diffusers/PEFT versions.
    loader.load_lora_into_unet(
        sd, alphas, unet, adapter_name=adapter_name, metadata=metadata, low_cpu_mem_usage=True, hotswap=hotswap
    )


def prepare_hotswap(unet: nn.Module, first: BenchAdapter, loader: type, rank: int) -> None:
    """The documented diffusers order: enable_lora_hotswap(target_rank), then a normal first load."""
    unet.enable_lora_hotswap(target_rank=rank)
    load_file(unet, loader, first.path, NAME)


def measure_hotswap(unet: nn.Module, adapters: list[BenchAdapter], loader: type, repeats: int) -> Hotswap:
    """diffusers' hotswap cycling through `adapters`, from the file and from a cached dict with its config."""
    device = device_of(unet)
    from_file = timed(
        lambda i: load_file(unet, loader, adapters[i % len(adapters)].path, NAME, hotswap=True), repeats, device
    )
    cached = [(a.peft_state_dict(), a.lora_config()) for a in adapters]

    def from_dict(i: int) -> None:
        sd, config = cached[i % len(cached)]
        unet.load_lora_adapter(sd, prefix=None, metadata=config, adapter_name=NAME, hotswap=True)

    return Hotswap(from_file=from_file, from_dict=timed(from_dict, repeats, device))


def measure_reload(unet: nn.Module, adapters: list[BenchAdapter], loader: type, repeats: int) -> Reload:
    """Reload per request: drop the adapter (delete_adapters, or unload_lora) and load the next one from disk."""
    device = device_of(unet)
    load_file(unet, loader, adapters[0].path, NAME)

    def delete_load(i: int) -> None:
        unet.delete_adapters(NAME)
        load_file(unet, loader, adapters[i % len(adapters)].path, NAME)

    def unload_load(i: int) -> None:
        unet.unload_lora()
        load_file(unet, loader, adapters[i % len(adapters)].path, NAME)

    def read(i: int) -> None:
        path = adapters[i % len(adapters)].path
        loader.lora_state_dict(str(path.parent), weight_name=path.name, use_safetensors=True)

    return Reload(
        delete_load=timed(delete_load, repeats, device),
        unload_load=timed(unload_load, repeats, device),
        read_file=timed(read, repeats, device),
    )


def measure_resident(
    unet: nn.Module,
    adapters: list[BenchAdapter],
    loader: type,
    counts: tuple[int, ...],
    repeats: int,
    inputs: Inputs | None = None,
) -> Resident:
    """All adapters resident, the unused at weight 0: each one is still computed, so the forward grows with N."""
    device = device_of(unet)
    set_ms, fwd_ms = [], []
    for i in range(max(counts)):
        load_file(unet, loader, adapters[i % len(adapters)].path, f"resident{i}")  # copies when files run out
        if i + 1 not in counts:
            continue
        names, weights = [f"resident{j}" for j in range(i + 1)], [1.0] + [0.0] * i
        set_ms.append(timed(lambda _, names=names, weights=weights: unet.set_adapters(names, weights), repeats, device))
        if inputs is not None:
            fwd_ms.append(timed_forward(unet, inputs, repeats))
    return Resident(tuple(counts), tuple(set_ms), tuple(fwd_ms) if inputs is not None else None)


def measure_slots(
    make_unet: Callable[[], nn.Module],
    modules: set[str],
    rank: int,
    weights: list[AdapterWeights],
    counts: tuple[int, ...],
    inputs: Inputs,
    repeats: int,
) -> Slots:
    """Forward time with K hotswap slots, each filled with an adapter: what combining K LoRAs costs per step."""
    unet = make_unet()
    base = timed_forward(unet, inputs, repeats)
    fwd = []
    for k in counts:
        del unet  # a fresh denoiser per K (templates are never removed in place); one in memory at a time
        unet = make_unet()
        for slot, w in zip(prepare_engine(unet, modules, rank, k), itertools.cycle(weights)):
            slot.load(w, 1.0)
        fwd.append(timed_forward(unet, inputs, repeats))
    return Slots(tuple(counts), base, tuple(fwd))


# ---- compile and checks -------------------------------------------------------------------------------------------


def measure_compile(
    unet: nn.Module, slot: LiveSlot, weights: list[AdapterWeights], inputs: Inputs, swaps: int = 10
) -> Compiled:
    """Compile the engine's denoiser once, then swap `swaps` times with a forward after each, counting new graphs."""
    compile_denoiser(unet)
    t0 = time.perf_counter()
    forward(unet, inputs)
    sync(device_of(unet))
    compile_s = time.perf_counter() - t0
    graphs = counters["stats"]["unique_graphs"]
    for i in range(swaps):
        slot.load(weights[i % len(weights)], 1.0)
        out = forward(unet, inputs)
    recompiles = counters["stats"]["unique_graphs"] - graphs
    with torch.no_grad():
        eager = unet.forward(**inputs).sample  # Module.compile wraps __call__ only
    return Compiled(compile_s, swaps, recompiles, float((out - eager).abs().max()))


@torch.no_grad()
def effective_weights(unet: nn.Module, adapter_name: str, probe_cols: int = 4) -> dict[str, torch.Tensor]:
    """scaling * B @ A per LoRA module, applied to a fixed random probe: equal probes mean equal effective weights
    whatever the padding, at a fraction of the cost of forming every B @ A."""
    out = {}
    for name, layer in unet.named_modules():
        if isinstance(layer, LoraLayer) and adapter_name in layer.lora_A:
            A = layer.lora_A[adapter_name].weight.flatten(1).float()
            B = layer.lora_B[adapter_name].weight.flatten(1).float()
            probe = torch.randn(A.shape[1], probe_cols, generator=torch.Generator().manual_seed(A.shape[1]))
            out[name] = float(layer.scaling[adapter_name]) * (B @ (A @ probe.to(A.device))).cpu()
    return out


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest difference over both modules sets; a module only one side has must be zero on that side."""
    zero = torch.zeros(())
    return max(float((a.get(k, zero) - b.get(k, zero)).abs().max()) for k in a.keys() | b.keys())


def _copy_pairs(slot: LiveSlot, weights: AdapterWeights) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model view, adapter tensor) for every A and B, made once so the floor times the copies alone."""
    pairs = []
    for key, m in weights.modules.items():
        live = slot.modules[key]
        pairs += [(live.A[: m.rank], m.A), (live.B[:, : m.rank], m.B)]
    return pairs
