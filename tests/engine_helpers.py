"""The tiny pipeline, the test adapters written for it, engines over them, and what plain diffusers gives for the
same request: shared by the test modules that run a model. It imports torch and diffusers, so the unit tests never
import it."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch
from diffusers import StableDiffusionPipeline

from lora_manager import AdapterSpec, Catalog, LoraManager
from lora_manager.adapters.inspection import BLOCKS
from lora_manager.images import levels
from lora_manager.testing import same_slots, snapshot

from helpers import GEN, PROMPT, TINY_MODEL

# Adapters that between them cover what the engine must handle: ranks 4..16 with an odd one, alphas above, below
# and not a multiple of the rank, attention-only and attention+ff+conv targets, kohya keys, text-encoder parts.
ADAPTERS = {
    "r4_attn": dict(rank=4, alpha=4, seed=1),
    "r7_conv": dict(rank=7, alpha=11, suffixes=BLOCKS, seed=2),
    "r16_half": dict(rank=16, alpha=8, seed=3),
    "r8_kohya": dict(rank=8, alpha=16, kohya=True, seed=4),
    "r6_te": dict(rank=6, alpha=3, te_rank=6, te_alpha=12, seed=5),
    "r4_kohya_te": dict(rank=4, alpha=2, te_rank=4, te_alpha=8, kohya=True, seed=6),
}


def load_tiny(dtype: torch.dtype = torch.float32) -> StableDiffusionPipeline:
    pipe = StableDiffusionPipeline.from_pretrained(TINY_MODEL, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make_catalog(adapter_dir: Path, names=tuple(ADAPTERS)) -> Catalog:
    specs = tuple(AdapterSpec(id=n, source=str(adapter_dir / f"{n}.safetensors")) for n in names)
    return Catalog(name="test", base_model=str(TINY_MODEL), adapters=specs, generation=GEN)


def reference(adapter_path: Path | None, strength: float = 1.0, seed: int = 0, prompt: str = PROMPT) -> np.ndarray:
    """What a fresh plain-diffusers pipeline gives with only that adapter loaded by `load_lora_weights`."""
    return mix_reference([(adapter_path, strength)] if adapter_path is not None else [], seed, prompt)


def mix_reference(
    adapters: list[tuple[Path, float]], seed: int = 0, prompt: str = PROMPT, dtype: torch.dtype = torch.float32
) -> np.ndarray:
    """Plain diffusers with each adapter loaded normally, combined by `set_adapters(names, strengths)`."""
    pipe = load_tiny(dtype)
    for i, (path, _) in enumerate(adapters):
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=f"ref{i}")
    if adapters and (len(adapters) > 1 or adapters[0][1] != 1.0):
        pipe.set_adapters([f"ref{i}" for i in range(len(adapters))], [s for _, s in adapters])
    # PEFT adds lora_dropout modules in training mode: without eval() plain diffusers applies dropout at inference.
    pipe.unet.eval()
    pipe.text_encoder.eval()
    gen = torch.Generator("cpu").manual_seed(seed)
    return pipe(prompt, generator=gen, output_type="np", **GEN).images[0]


def as_float(manager: LoraManager, adapter: str | None, strength: float = 1.0, seed: int = 0) -> np.ndarray:
    return manager.generate(PROMPT, adapter=adapter, strength=strength, seed=seed, output_type="np").image


def assert_same_image(got: np.ndarray, want: np.ndarray) -> None:
    """The issue's bar: within 1e-4 on the float output, or at most 1 level of 255 once converted to 8 bits."""
    err = float(np.abs(got - want).max())
    diff = levels(got, want)
    assert err <= 1e-4 or diff <= 1, f"max abs diff {err:.2e}, {diff} levels of 255"


def one(adapter: str | None, strength: float) -> tuple:
    """The engine's request form (a Mix) for a single adapter, for tests that call `residency.make_resident`."""
    return ((adapter, strength),) if adapter else ()


def run_together(m: LoraManager, requests: list[tuple], **params) -> list:
    """Queue `requests` (mix, seed, prompt) while the worker is held, so the scheduler sees them all at once."""
    gate = threading.Event()
    blocker = m.submit(PROMPT, callback_on_step_end=lambda *a: (gate.wait(), a[3])[1])
    futures = [m.submit(prompt, adapter=mix, seed=seed, output_type="np", **params) for mix, seed, prompt in requests]
    gate.set()
    blocker.result()
    return [f.result() for f in futures]


def evict_all_but(m: LoraManager, adapter_dir: Path, resident: tuple[str, ...]) -> None:
    """Evict every adapter but `resident` from the CPU cache: for a moment a budget that holds only them and one
    filler, which is registered (a registration is always kept, evicting the others)."""
    budget = m.store.budget_bytes
    m.store.budget_bytes = sum(m.info(a).bytes for a in resident) + m.info("r6_te").bytes
    try:
        m.register("filler", str(adapter_dir / "r6_te.safetensors"))
    finally:
        m.store.budget_bytes = budget


def break_while_evicted(m: LoraManager, adapter_dir: Path, victim: Path, resident: tuple[str, ...]) -> None:
    """Evict every adapter but `resident` from the CPU cache, then empty the evicted `victim` file: the engine finds it
    broken only when it re-reads it."""
    evict_all_but(m, adapter_dir, resident)
    assert m.info("victim").status == "evicted"
    victim.write_bytes(b"")


def snapshot_slots(manager: LoraManager) -> list[dict]:
    return snapshot(manager.residency.mix_slots)


def assert_same_slots(before: list[dict], after: list[dict]) -> None:
    """Every slot's A, B and scaling bit-identical."""
    assert same_slots(before, after)


def served(engine: LoraManager, adapter: str | None) -> np.ndarray:
    return engine.generate(PROMPT, adapter=adapter, seed=0, output_type="np").image


def serve_compiled(catalog: str, steps: list[str | None], out: str) -> None:
    """Serve `steps` on a compiled engine of `catalog` and save the images and stats to `out` (.npz).

    test_formats runs it in a process of its own: diffusers' LoRA-scale decorator gives every denoiser's `forward` the
    same code object, so in the test process (where the tiny engine is compiled too) compiling the Flux transformer
    would be a recompile of that code, which `error_on_recompile` turns into an error.
    """
    engine = LoraManager.from_preset(catalog, compile=True, device="cpu")
    with torch._dynamo.config.patch(error_on_recompile=True):
        images = np.stack([served(engine, adapter) for adapter in steps])
    stats = engine.stats()
    engine.close()
    np.savez(out, images=images, compiled=stats["compiled"], recompiles=stats["recompiles"], swaps=stats["swaps"])
