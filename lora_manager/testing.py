"""Shared by the tests, the benchmarks, the Space's Compare tab and the tutorial: real LoRA files with chosen ranks,
alphas, targets and key formats; slot comparisons; a free port and `python app.py` started on it. The engine
never imports this module."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .adapters.inspection import ATTENTION, TEXT_ATTENTION
from .adapters.validate import lora_shapes
from .hotswap.slot import LiveSlot
from .tiny_model.kohya import to_kohya

SlotSnapshot = dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, float]]


def lora_layers(
    model: torch.nn.Module, suffixes: Iterable[str], rank: int, seed: int | torch.Generator, scale: float
) -> dict[str, torch.Tensor]:
    """Random A/B for every Linear/Conv2d whose name ends with one of `suffixes`, in PEFT layout, drawn from `seed`
    (or from a generator the caller goes on drawing from).

    A ~ N(0, 1/fan_in) and B ~ N(0, scale^2/r), so B(A(x)) is about `scale` times x: a realistic style delta,
    not one that drives the network into a regime where rounding differences blow up.
    """
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    sd = {}
    for name, layer in model.named_modules():
        if name.endswith(tuple(suffixes)) and isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            a_shape, b_shape = lora_shapes(layer, rank)
            fan_in = a_shape[1] * (a_shape[2] * a_shape[3] if len(a_shape) == 4 else 1)
            sd[f"{name}.lora_A.weight"] = torch.randn(a_shape, generator=g) / fan_in**0.5
            sd[f"{name}.lora_B.weight"] = torch.randn(b_shape, generator=g) * scale / rank**0.5
    return sd


def lora_config(state_dict: dict[str, torch.Tensor], rank: int, alpha: float) -> dict:
    """The LoraConfig fields diffusers saves as metadata (`*_lora_adapter_metadata`), so alpha survives the file."""
    return {"r": rank, "lora_alpha": alpha, "target_modules": sorted({k.split(".lora_")[0] for k in state_dict})}


def write_adapter(
    pipe,
    path: Path,
    rank: int,
    alpha: float,
    suffixes: Iterable[str] = ATTENTION,
    te_rank: int | None = None,
    te_alpha: float | None = None,
    kohya: bool = False,
    seed: int = 0,
    scale: float = 0.3,
) -> Path:
    """Save an adapter for the denoiser (a UNet: SD, SDXL; a transformer: Flux) and optionally the first text encoder
    as diffusers would (alpha in the metadata), or, for a UNet, in kohya keys (alpha as `.alpha` tensors)."""
    denoiser = "transformer" if getattr(pipe, "transformer", None) is not None else "unet"
    layers = lora_layers(getattr(pipe, denoiser), suffixes, rank, seed, scale)
    te = lora_layers(pipe.text_encoder, TEXT_ATTENTION, te_rank, seed + 1, scale) if te_rank else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    if kohya:
        if denoiser != "unet":
            raise ValueError("kohya keys are written for UNet pipelines (SD, SDXL) only")
        packed = {f"unet.{k}": v for k, v in layers.items()} | {f"text_encoder.{k}": v for k, v in te.items()}
        save_file(to_kohya(packed, {"unet": alpha, "text_encoder": te_alpha or 0.0}), str(path))
        return path
    type(pipe).save_lora_weights(
        str(path.parent),
        text_encoder_lora_layers=te or None,
        weight_name=path.name,
        text_encoder_lora_adapter_metadata=lora_config(te, te_rank, te_alpha) if te else None,
        **{f"{denoiser}_lora_layers": layers, f"{denoiser}_lora_adapter_metadata": lora_config(layers, rank, alpha)},
    )
    return path


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a safetensors file through `edit(tensors, metadata)`, keeping diffusers' metadata unless edited."""
    with safe_open(str(src), "pt") as f:
        metadata = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors, metadata)
    save_file(tensors, str(dst), metadata=metadata)
    return dst


def snapshot(slots: Iterable[LiveSlot]) -> list[SlotSnapshot]:
    """Copies of every live tensor of each slot, to prove later that a refused adapter changed nothing."""
    return [{k: (v.A.clone(), v.B.clone(), float(v.scaling)) for k, v in slot.modules.items()} for slot in slots]


def same_slots(before: list[SlotSnapshot], after: list[SlotSnapshot]) -> bool:
    """Every slot's A, B and scaling bit-identical."""
    return len(before) == len(after) and all(
        b.keys() == a.keys()
        and all(torch.equal(b[k][0], a[k][0]) and torch.equal(b[k][1], a[k][1]) and b[k][2] == a[k][2] for k in b)
        for b, a in zip(before, after, strict=True)
    )


def free_port() -> int:
    """A TCP port nothing listens on right now, for a server a test or benchmark starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_app(
    app: Path, args: Sequence[str], env: dict[str, str], timeout_s: float, python: str = sys.executable
) -> Iterator[tuple[str, str]]:
    """Start `python app.py` (with the interpreter `python`) on 127.0.0.1 at a free port; yield its URL and what it
    printed up to its "ready in" line (that line last) once it prints it, then stop it. Its output goes to a file, so
    an app left running never blocks on a full pipe."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [python, str(app), "--host", "127.0.0.1", "--port", str(port), *args],
            cwd=app.parent,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                log.seek(0)
                text = log.read()
                start = text.find("ready in")
                if start >= 0 and (end := text.find("\n", start)) >= 0:
                    ready = text[:end]  # everything printed up to the end of the ready line
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"app.py did not start (rc={proc.poll()}):\n{text[-4000:]}")
                time.sleep(0.2)
            yield f"http://127.0.0.1:{port}/", ready
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
