"""`python -m lora_manager bench`: every way of switching LoRAs, measured side by side on the same adapters.

--scale tiny: the shipped tiny preset and its denoiser-only adapters; forwards are cheap, so the forward cost of
resident adapters, the engine-vs-hotswap output check and (--compile) recompiles are measured too.
--scale sdxl: an SDXL-size UNet built from its config with uninitialized weights (their values do not matter for
swap timing; on CUDA they are filled so a forward can be timed) and random attention LoRAs of rank 64, 48 and 16.
Nothing is downloaded. See `strategies.py` for what each number is.

Mixed-adapter batches (`hotswap/batched.py`): a denoiser forward over MIXED_REQUESTS requests (classifier-free
guidance: twice as many rows) without LoRA, with one template slot shared by every row (a same-adapter batch), and
with gathered per-row LoRA over device slots holding different adapters, at the workload's rank and at rank 64. Where
no forward can be timed (SDXL on CPU) the same code is timed on single SDXL-width attention projections instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import diffusers
import peft
import torch
from diffusers import UNet2DConditionModel
from diffusers.loaders import StableDiffusionLoraLoaderMixin, StableDiffusionXLLoraLoaderMixin
from torch import nn

from ..adapters.catalog import load_preset, resolve_base_model
from ..adapters.inspection import ATTENTION
from ..adapters.reader import AdapterWeights, ModuleLora, read_adapter
from ..adapters.sources import resolve
from ..adapters.store import AdapterStore
from ..hotswap.batched import install
from ..hotswap.rows import BatchRows
from ..hotswap.slot import LiveSlot
from ..hotswap.template import SLOT, prepare_template, slot_names
from ..testing import lora_layers
from . import strategies as S

# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (the keys that differ from diffusers' defaults).
SDXL_UNET = {
    "sample_size": 128,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "block_out_channels": (320, 640, 1280),
    "transformer_layers_per_block": (1, 2, 10),
    "attention_head_dim": (5, 10, 20),
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
}
# (name, rank, alpha): two rank-64 adapters for the like-for-like swap, smaller ranks for the mixed-rank swap.
SDXL_ADAPTERS = (("r64a", 64, 64.0), ("r64b", 64, 32.0), ("r16", 16, 8.0), ("r48", 48, 24.0))
RESIDENT_COUNTS = (1, 2, 5, 10)
SLOT_COUNTS = (1, 2, 3)
MIXED_REQUESTS = 8  # requests in one mixed batch (16 denoiser rows under classifier-free guidance)
MIXED_RANKS = (64,)  # measured besides the workload's own target rank
# SDXL attention projections (width, tokens at 1024x1024) for the per-layer estimate where no forward is timed
SDXL_LAYERS = ((640, 4096), (1280, 1024))
DEFAULT_DTYPE = {"tiny": "float32", "sdxl": "bfloat16"}
COMPILE_SWAPS = 10
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Workload:
    """What every strategy runs on: a fresh denoiser per strategy, and the same adapters for all of them."""

    make_unet: Callable[[], nn.Module]
    loader: type  # the diffusers LoRA loader the files are read with
    primary: list[S.BenchAdapter]  # same target modules: every strategy cycles through these
    mixed: list[S.BenchAdapter]  # other ranks (tiny: other targets too), which only the engine swaps between
    check: tuple[S.BenchAdapter, ...]  # loaded in this order by the engine and by diffusers' hotswap, then compared
    target_rank: int
    inputs: S.Inputs | None  # denoiser inputs; None where a forward is too slow to time (SDXL on CPU)
    slot_weights: list[AdapterWeights]  # what fills the K hotswap slots when their forward cost is timed
    compare_outputs: bool
    notes: list[str] = field(default_factory=list)


def run(scale: str, repeats: int, device: str | None = None, dtype: str | None = None, compile: bool = False) -> dict:
    """Build the workload for `scale`, measure every strategy on it, and return the JSON report."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = getattr(torch, dtype or DEFAULT_DTYPE[scale])
    with tempfile.TemporaryDirectory(prefix="lora_bench_") as tmp:
        wl = tiny_workload(dev, dt) if scale == "tiny" else sdxl_workload(dev, dt, Path(tmp))
        measured = measure(wl, repeats, compile)
    adapters = [
        {
            "name": a.name,
            "rank": a.rank,
            "alpha": a.weights.alpha,
            "modules": len(a.weights.modules),
            "mib": round(a.weights.nbytes / 2**20, 2),
        }
        for a in _unique(wl.primary + wl.mixed)
    ]
    return {
        "scale": scale,
        "dtype": str(dt).removeprefix("torch."),
        "device": str(dev),
        "repeats": repeats,
        "target_rank": wl.target_rank,
        "adapters": adapters,
        "swap_cycle": [a.name for a in wl.primary],
        "mixed_cycle": [a.name for a in wl.mixed],
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__, "peft": peft.__version__},
        "machine": _machine(dev),
        **measured,
    }


def measure(wl: Workload, repeats: int, compile: bool) -> dict:
    """Each strategy on its own fresh denoiser; the engine's model is kept for the check, forward and compile."""
    primary = [a.weights for a in wl.primary]
    unet = wl.make_unet()
    slot = S.prepare_engine(unet, {m for a in wl.primary + wl.mixed for _, m in a.weights.modules}, wl.target_rank)[0]
    floors = S.measure_floors(slot, primary, repeats)
    engine = S.measure_engine_swap(slot, primary, repeats)
    engine_mixed = S.measure_engine_swap(slot, [a.weights for a in wl.mixed], repeats)
    hot_unet = wl.make_unet()
    S.prepare_hotswap(hot_unet, wl.primary[0], wl.loader, wl.target_rank)
    hotswap = S.measure_hotswap(hot_unet, wl.primary, wl.loader, repeats)
    check = _check(wl, slot, unet, hot_unet)
    del hot_unet
    reload = S.measure_reload(wl.make_unet(), wl.primary, wl.loader, repeats)
    resident = S.measure_resident(wl.make_unet(), wl.primary, wl.loader, RESIDENT_COUNTS, repeats, wl.inputs)
    notes = list(wl.notes)
    engine_forward, compiled, slots = None, None, None
    if wl.inputs is not None:
        modules = {m for a in wl.primary + wl.mixed for _, m in a.weights.modules}
        slots = S.measure_slots(wl.make_unet, modules, wl.target_rank, wl.slot_weights, SLOT_COUNTS, wl.inputs, repeats)
    mixed = measure_mixed(wl, repeats) if wl.inputs is not None else measure_mixed_layers(wl, max(1, repeats // 3))
    if wl.inputs is not None:
        engine_forward = S.timed_forward(unet, wl.inputs, repeats)
        if compile:
            compiled = S.measure_compile(unet, slot, primary, wl.inputs, COMPILE_SWAPS)
    elif compile:
        notes.append("--compile needs a forward pass: not measured at this scale on this device.")
    timings = {
        "floor_flat_ms": floors.flat,
        "floor_per_tensor_ms": floors.per_tensor,
        "engine_swap_ms": engine,
        "engine_swap_mixed_ms": engine_mixed,
        "diffusers_hotswap_ms": hotswap.from_file,
        "diffusers_hotswap_dict_ms": hotswap.from_dict,
        f"set_adapters_{max(resident.counts)}_resident_ms": resident.set_adapters[-1],
        "load_from_disk_ms": reload.read_file,
        "delete_load_ms": reload.delete_load,
        "unload_load_ms": reload.unload_load,
    }
    forward = engine_forward.median_ms if engine_forward else None
    return _report(timings, resident, slots, forward) | {
        "compile": asdict(compiled) if compiled else None,
        "mixed_batch": mixed,
        "check": check,
        "notes": notes,
    }


def _report(timings: dict, resident, slots, engine_forward_ms: float | None) -> dict:
    """The timings' medians, samples and ratios, and the resident-adapters and slots sweeps, as the JSON holds them."""
    results = {k: t.median_ms for k, t in timings.items()}
    return {
        "results": results,
        "ratios": {
            "engine_swap_vs_floor_per_tensor": results["engine_swap_ms"] / results["floor_per_tensor_ms"],
            "diffusers_hotswap_vs_engine_swap": results["diffusers_hotswap_ms"] / results["engine_swap_ms"],
        },
        "samples_ms": {k: list(t.samples_ms) for k, t in timings.items()},
        "resident": {
            "counts": list(resident.counts),
            "set_adapters_ms": [t.median_ms for t in resident.set_adapters],
            "forward_ms": [t.median_ms for t in resident.forward] if resident.forward else None,
            "engine_forward_ms": engine_forward_ms,
        },
        "slots": {
            "counts": list(slots.counts),
            "base_forward_ms": slots.base_forward.median_ms,
            "forward_ms": [t.median_ms for t in slots.forward],
        }
        if slots
        else None,
    }


def engine_matches_hotswap(wl: Workload) -> dict:
    """The engine-vs-hotswap check alone, on two fresh denoisers: for a dtype or device without timing anything."""
    unet = wl.make_unet()
    slot = S.prepare_engine(unet, {m for a in wl.primary + wl.mixed for _, m in a.weights.modules}, wl.target_rank)[0]
    hot_unet = wl.make_unet()
    S.prepare_hotswap(hot_unet, wl.primary[0], wl.loader, wl.target_rank)
    return _check(wl, slot, unet, hot_unet)


def _check(wl: Workload, slot, unet: nn.Module, hot_unet: nn.Module) -> dict:
    """The same adapters through the engine and through diffusers' hotswap must leave the same effective weights
    (and, at tiny scale, the same denoiser output; `output_lora_effect` shows the adapter really changes it)."""
    for a in wl.check:
        slot.load(a.weights, 1.0)
        S.load_file(hot_unet, wl.loader, a.path, S.NAME, hotswap=True)
    out = {
        "sequence": [a.name for a in wl.check],
        "tolerance": TOLERANCE,
        "effective_weights_max_abs_diff": S.max_abs_diff(
            S.effective_weights(unet, SLOT), S.effective_weights(hot_unet, S.NAME)
        ),
    }
    if wl.compare_outputs:
        swapped, hotswapped = S.forward(unet, wl.inputs), S.forward(hot_unet, wl.inputs)
        slot.load(None, 0.0)
        base = S.forward(unet, wl.inputs)
        out["output_max_abs_diff"] = float((swapped - hotswapped).abs().max())
        out["output_lora_effect"] = float((swapped - base).abs().max())
    out["ok"] = all(v <= TOLERANCE for k, v in out.items() if k.endswith("max_abs_diff"))
    return out


def prepare_gathered(
    unet: nn.Module, modules: set[str], rank: int, weights: list[AdapterWeights], requests: int
) -> BatchRows:
    """The engine's mixed-batch preparation on a bare denoiser (`prepare_template` with rows): one zero
    template per device slot, re-based onto stacks, each slot filled with one of `weights`; row i picks slot i % D."""
    rows = BatchRows(requests, 1, S.device_of(unet))
    slots = prepare_template(unet, {"unet": unet}, {("unet", m) for m in modules}, rank, len(weights), rows)
    for slot, w in zip(slots, weights, strict=True):
        slot.load(w, 1.0)
    rows.write([[(i % len(weights), 1.0)] for i in range(requests)], slots)
    return rows


def measure_mixed(wl: Workload, repeats: int) -> dict:
    """Forward ms over MIXED_REQUESTS requests: no LoRA, one template slot for all rows, gathered per-row LoRA."""
    inputs = _repeat_rows(wl.inputs, MIXED_REQUESTS)
    modules = {m for a in wl.primary + wl.mixed for _, m in a.weights.modules}
    base = wl.make_unet()
    out = {
        "requests": MIXED_REQUESTS,
        "rows": MIXED_REQUESTS * 2,
        "device_slots": len(wl.slot_weights),
        "no_lora_ms": S.timed_forward(base, inputs, repeats).median_ms,
    }
    del base
    for rank in (wl.target_rank, *MIXED_RANKS):
        one = wl.make_unet()
        S.prepare_engine(one, modules, rank)[0].load(wl.slot_weights[0], 1.0)
        same = S.timed_forward(one, inputs, repeats).median_ms
        del one
        gathered = wl.make_unet()
        prepare_gathered(gathered, modules, rank, wl.slot_weights, MIXED_REQUESTS)
        mixed = S.timed_forward(gathered, inputs, repeats).median_ms
        del gathered
        out[f"rank{rank}"] = {"one_slot_same_adapter_ms": same, "gathered_mixed_ms": mixed}
    return out


def measure_mixed_layers(wl: Workload, repeats: int) -> dict:
    """Where the whole denoiser cannot be timed: one attention projection per SDXL width, as a Linear without LoRA,
    with PEFT's single LoRA branch for all rows, and with the gathered per-row branch over the device slots."""
    from peft import LoraConfig, inject_adapter_in_model

    device = torch.device("cpu")  # only used where no forward can be timed, i.e. without CUDA
    rows_n, slots, rank = MIXED_REQUESTS // 2, len(wl.slot_weights), wl.target_rank
    out = {
        "requests": rows_n,
        "rows": rows_n * 2,
        "device_slots": slots,
        "rank": rank,
        "dtype": "float32",
        "layers": [],
    }
    for width, tokens in SDXL_LAYERS:
        model = nn.Sequential(nn.Linear(width, width)).to(device).requires_grad_(False)
        x = torch.randn(rows_n * 2, tokens, width, device=device)
        names = slot_names(slots)
        with torch.no_grad():
            base = _call_ms(model, x, repeats, device)
            for name in names:
                config = LoraConfig(r=rank, lora_alpha=rank, target_modules=["0"], init_lora_weights=False)
                inject_adapter_in_model(config, model, adapter_name=name)
            model[0].set_adapter([names[0]], inference_mode=True)
            one = _call_ms(model, x, repeats, device)
            rows = BatchRows(rows_n, 1, device)
            install({"m": model}, names, rows)
            live = [LiveSlot({"m": model}, n) for n in names]
            for slot, n in zip(live, names, strict=True):
                slot.load(_as_weights(model[0], n), 1.0)
            rows.write([[(i % slots, 1.0)] for i in range(rows_n)], live)
            gathered = _call_ms(model, x, repeats, device)
        out["layers"].append(
            {"width": width, "tokens": tokens, "no_lora_ms": base, "one_branch_ms": one, "gathered_mixed_ms": gathered}
        )
    return out


def _as_weights(layer, name: str) -> AdapterWeights:
    """PEFT's own weights for one adapter of a bare LoRA layer, as the adapter the gathered forward plans for."""
    A, B = layer.lora_A[name].weight.clone(), layer.lora_B[name].weight.clone()
    return AdapterWeights({("m", "0"): ModuleLora(A, B, alpha=A.shape[0], scale=1.0)}, format="peft")


def _call_ms(model: nn.Module, x: torch.Tensor, repeats: int, device: torch.device) -> float:
    """Median ms of `model(x)`."""
    return S.timed(lambda _: model(x), repeats, device).median_ms


def _repeat_rows(inputs: S.Inputs, requests: int) -> S.Inputs:
    """The denoiser inputs of one request ([uncond; cond]) for `requests` requests: [uncond x N; cond x N]."""

    def rep(v):
        if isinstance(v, dict):
            return {k: rep(t) for k, t in v.items()}
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.repeat_interleave(requests, dim=0)
        return v

    return {k: rep(v) for k, v in inputs.items()}


# ---- workloads ----------------------------------------------------------------------------------------------------


def tiny_workload(device: torch.device, dtype: torch.dtype) -> Workload:
    """The tiny preset's denoiser-only adapters (diffusers' hotswap reaches only the denoiser: a text-encoder part
    would leave the pipeline half-swapped)."""
    loader = StableDiffusionLoraLoaderMixin
    catalog, root = load_preset("tiny")
    model = Path(resolve_base_model(catalog, root))
    adapters = []
    for spec in catalog.adapters:
        path = resolve(spec.source, spec.id, spec.weight_name, spec.revision, True, root)
        weights = read_adapter(path, spec.id, loader, {"unet": None, "text_encoder": None}, dtype)
        if weights.components == {"unet"}:
            adapters.append(S.BenchAdapter(spec.id, path, _host(weights, device)))
    by_targets = defaultdict(list)
    for a in adapters:
        by_targets[frozenset(a.weights.modules)].append(a)
    primary = max(by_targets.values(), key=len)  # diffusers' hotswap needs the first adapter's targets to cover all
    by_rank = sorted(primary, key=lambda a: a.rank)

    def make_unet() -> nn.Module:
        return UNet2DConditionModel.from_pretrained(model, subfolder="unet", dtype=dtype).to(device).eval()

    return Workload(
        make_unet=make_unet,
        loader=loader,
        primary=primary,
        mixed=adapters,
        check=(by_rank[-1], by_rank[0]),  # the smallest rank after the largest: the padding must be zeroed
        target_rank=max(a.rank for a in adapters),
        inputs=_tiny_inputs(model, device, dtype),
        slot_weights=[a.weights for a in by_rank],
        compare_outputs=True,
    )


def sdxl_workload(device: torch.device, dtype: torch.dtype, folder: Path) -> Workload:
    """An SDXL-size UNet and random rank-64/48/16 attention LoRAs, written as SDXL LoRA files into `folder`."""
    loader = StableDiffusionXLLoraLoaderMixin
    shapes = _sdxl_unet(torch.device("meta"), dtype)
    adapters = {
        name: _random_adapter(shapes, loader, folder, name, rank, alpha, seed, dtype, device)
        for seed, (name, rank, alpha) in enumerate(SDXL_ADAPTERS)
    }
    forward = device.type == "cuda"
    notes = (
        []
        if forward
        else [
            "SDXL forward not timed on CPU (minutes per call even at 256x256 in bf16): resident "
            "cost is set_adapters only, and the K-slot forward cost is not measured."
        ]
    )
    return Workload(
        make_unet=lambda: _sdxl_unet(device, dtype, filled=forward),
        loader=loader,
        primary=[adapters["r64a"], adapters["r64b"]],
        mixed=[adapters["r64a"], adapters["r16"], adapters["r48"]],
        check=(adapters["r64a"], adapters["r16"]),
        target_rank=max(rank for _, rank, _ in SDXL_ADAPTERS),
        inputs=_sdxl_inputs(device, dtype) if forward else None,
        slot_weights=[adapters[n].weights for n in ("r64a", "r64b", "r48")],
        compare_outputs=False,
        notes=notes,
    )


def _sdxl_unet(device: torch.device, dtype: torch.dtype, filled: bool = False) -> nn.Module:
    """Built on the meta device (no init, ~1 s), then given real but uninitialized storage."""
    with _default_dtype(dtype), torch.device("meta"):
        unet = UNet2DConditionModel(**SDXL_UNET)
    if device.type != "meta":
        unet = unet.to_empty(device=device)
    if filled:  # uninitialized memory may hold NaN/Inf; a timed forward should not run on that
        with torch.no_grad():
            for p in unet.parameters():
                p.normal_(0.0, 0.02)
    return unet.eval()


def _random_adapter(
    shapes: nn.Module,
    loader: type,
    folder: Path,
    name: str,
    rank: int,
    alpha: float,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
) -> S.BenchAdapter:
    """A random attention LoRA over `shapes`' modules, saved as diffusers would and held as the engine holds it."""
    sd = lora_layers(shapes, ATTENTION, rank, seed, scale=0.01 * rank**0.5)  # B ~ N(0, 0.01^2)
    modules = {}
    for key, A in sd.items():
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            B = sd[f"{module}.lora_B.weight"]
            modules[("unet", module)] = ModuleLora(A=A.to(dtype), B=B.to(dtype), alpha=alpha, scale=alpha / rank)
    adapter = S.BenchAdapter(name, folder / f"{name}.safetensors", AdapterWeights(modules, format="peft"))
    loader.save_lora_weights(
        str(folder),
        unet_lora_layers=adapter.peft_state_dict(),
        weight_name=adapter.path.name,
        unet_lora_adapter_metadata=adapter.lora_config(),
    )
    return S.BenchAdapter(name, adapter.path, _host(adapter.weights, device))


def _tiny_inputs(model: Path, device: torch.device, dtype: torch.dtype) -> S.Inputs:
    """One classifier-free-guidance step's denoiser inputs (batch 2) at the preset's latent size."""
    unet = json.loads((model / "unet" / "config.json").read_text())
    tokens = json.loads((model / "text_encoder" / "config.json").read_text())["max_position_embeddings"]
    g = torch.Generator().manual_seed(0)
    size = unet["sample_size"]
    return {
        "sample": torch.randn(2, unet["in_channels"], size, size, generator=g).to(device, dtype),
        "timestep": torch.tensor(500, device=device),
        "encoder_hidden_states": torch.randn(2, tokens, unet["cross_attention_dim"], generator=g).to(device, dtype),
    }


def _sdxl_inputs(device: torch.device, dtype: torch.dtype) -> S.Inputs:
    """A 1024x1024 classifier-free-guidance step (batch 2, 77 tokens)."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    return {
        "sample": rand(2, 4, 128, 128),
        "timestep": torch.tensor(500, device=device),
        "encoder_hidden_states": rand(2, 77, 2048),
        "added_cond_kwargs": {"text_embeds": rand(2, 1280), "time_ids": rand(2, 6)},
    }


def _host(weights: AdapterWeights, device: torch.device) -> AdapterWeights:
    """Hold adapters as the engine's CPU cache does: page-locked when the model is on CUDA (store.py)."""
    return AdapterStore(weights.nbytes, pin_memory=device.type == "cuda").put("bench", weights)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """On a shared CPU, oversubscribed OpenMP threads make forward timings swing 30x; one thread keeps them steady."""
    old = torch.get_num_threads()
    torch.set_num_threads(n or old)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _unique(adapters: list[S.BenchAdapter]) -> list[S.BenchAdapter]:
    return list({a.name: a for a in adapters}.values())


def _machine(device: torch.device) -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "processor": platform.machine(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


# ---- output -------------------------------------------------------------------------------------------------------


def format_table(report: dict) -> str:
    """The results as aligned text, each against the per-tensor copy floor."""
    floor = report["results"]["floor_per_tensor_ms"]
    lines = [
        f"scale={report['scale']} dtype={report['dtype']} device={report['device']} "
        f"repeats={report['repeats']} target_rank={report['target_rank']}"
    ]
    lines += [f"  {k:<32} {v:>10.3f} ms  {v / floor:>7.2f}x floor" for k, v in report["results"].items()]
    res = report["resident"]
    lines.append(f"  set_adapters ms for N={res['counts']}: {[round(v, 2) for v in res['set_adapters_ms']]}")
    if res["forward_ms"]:
        lines.append(
            f"  forward ms for N resident: {[round(v, 2) for v in res['forward_ms']]}; "
            f"engine forward {res['engine_forward_ms']:.2f} ms"
        )
    if report["slots"]:
        sl = report["slots"]
        lines.append(
            f"  forward ms with K slots {sl['counts']}: {[round(v, 2) for v in sl['forward_ms']]}; "
            f"no LoRA layers {sl['base_forward_ms']:.2f} ms"
        )
    if report["compile"]:
        lines.append(f"  compile: {report['compile']}")
    lines.append(f"  mixed batch: {report['mixed_batch']}")
    lines.append(f"  check: {report['check']}")
    lines += [f"  note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def make_figure(report: dict):
    """Swap latencies side by side (log scale), and what resident adapters cost as N grows (a matplotlib Figure)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 5.5))
    bars, lines = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.4, 1]})
    items = sorted(report["results"].items(), key=lambda kv: kv[1])
    colors = [
        "tab:green" if k.startswith("engine") else "tab:gray" if k.startswith("floor") else "tab:orange"
        for k, _ in items
    ]
    bars.barh([k.removesuffix("_ms") for k, _ in items], [v for _, v in items], color=colors)
    for y, (_, v) in enumerate(items):
        bars.text(v, y, f" {v:.0f}" if v >= 100 else f" {v:.3g}", va="center", fontsize=8)
    bars.set_xscale("log")
    bars.set_xlabel("milliseconds per switch (median, log scale)")
    bars.set_title(f"Switching adapters: {report['scale']}, {report['dtype']}, {report['device']}")
    res = report["resident"]
    if res["forward_ms"]:
        lines.plot(
            res["counts"],
            res["forward_ms"],
            "o-",
            color="tab:orange",
            label="diffusers: N resident, unused at weight 0",
        )
        lines.axhline(
            res["engine_forward_ms"], ls="--", color="tab:green", label="engine: one slot, any N held in CPU memory"
        )
        slots = report["slots"]
        lines.plot(
            slots["counts"],
            slots["forward_ms"],
            "s:",
            color="tab:olive",
            label="engine: K slots, K LoRAs combined per request",
        )
        lines.set_ylabel("denoiser forward, ms")
        lines.set_title("Forward cost vs LoRAs the forward computes")
    else:
        lines.plot(res["counts"], res["set_adapters_ms"], "o-", color="tab:orange", label="set_adapters call")
        lines.axhline(report["results"]["engine_swap_ms"], ls="--", color="tab:green", label="engine swap")
        lines.set_ylabel("ms per switch")
        lines.set_title("Switch cost vs resident adapters (no forward timed)")
    lines.set_xlabel("adapters resident (N) / engine slots (K)")
    lines.set_xticks(res["counts"])
    lines.set_ylim(bottom=0)
    lines.legend()
    fig.tight_layout()
    return fig


def write_plot(report: dict, path: Path) -> None:
    make_figure(report).savefig(path, dpi=110)


def main(args: argparse.Namespace) -> None:
    with _threads(args.threads):
        report = run(args.scale, args.repeats, args.device, args.dtype, args.compile)
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        write_plot(report, Path(args.plot))
