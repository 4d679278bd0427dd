"""Half precision, as every GPU preset runs: the tiny pipeline in float16 and in bfloat16 on the CPU serves mixed
batches (rows with different LoRAs, two-LoRA rows, no LoRA), eager and compiled, from float32 LoRA files with
text-encoder parts. Each image is as close to float32 as plain diffusers' own image at that dtype, and its LoRA still
shows (it differs from the same seed without a LoRA about as much as in float32)."""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
import torch

from lora_manager import LoraManager
from lora_manager.dtypes import resolve_dtype
from lora_manager.images import to_8bit

from engine_helpers import load_tiny, make_catalog, mix_reference
from helpers import PROMPT

DTYPES = [torch.float16, torch.bfloat16]
PROMPTS = (PROMPT, "a green square on a yellow background", "a blue diamond on a white background")
# one batch of four: attention-only, conv, a text-encoder LoRA with a kohya one, and no LoRA
BATCH = [[("r4_attn", 1.0)], [("r7_conv", 0.8)], [("r6_te", 1.0), ("r8_kohya", 0.7)], []]
REQUESTS = [(mix, 20 + i, PROMPTS[i % 3]) for i, mix in enumerate(BATCH)]


def diff(a, b) -> float:
    """Mean per-pixel difference of two images, in levels of 255."""
    return float(np.abs(to_8bit(a) - to_8bit(b)).mean())


@functools.cache
def plain(adapter_dir, mix: tuple, seed: int, prompt: str, dtype: torch.dtype) -> np.ndarray:
    """Plain diffusers at `dtype`: each LoRA loaded by `load_lora_weights`, combined by `set_adapters`."""
    return mix_reference([(adapter_dir / f"{i}.safetensors", s) for i, s in mix], seed, prompt, dtype)


def run_together(m: LoraManager) -> list[np.ndarray]:
    """The four requests queued while the worker is held, so they run as one mixed batch."""
    gate = threading.Event()
    blocker = m.submit(PROMPT, callback_on_step_end=lambda *a: (gate.wait(), a[3])[1])
    futures = [m.submit(p, adapter=mix, seed=s, output_type="np") for mix, s, p in REQUESTS]
    gate.set()
    blocker.result()
    results = [f.result() for f in futures]
    assert [r.info["batch_size"] for r in results] == [4] * 4
    assert {r.info["dtype"] for r in results} == {str(m.dtype).removeprefix("torch.")}
    return [r.image for r in results]


def check_against_plain_diffusers(adapter_dir, images: list[np.ndarray], dtype: torch.dtype) -> None:
    """Per request: the engine's distance to float32 plain diffusers is within plain diffusers' own at `dtype` (plus a
    margin for summing the LoRA in another order), and the LoRA shows."""
    for (mix, seed, prompt), image in zip(REQUESTS, images, strict=True):
        mix = tuple(mix)
        full = plain(adapter_dir, mix, seed, prompt, torch.float32)
        own = diff(plain(adapter_dir, mix, seed, prompt, dtype), full)
        ours = diff(image, full)
        print(f"{dtype} {mix}: engine {ours:.2f}, plain diffusers {own:.2f} levels from float32")
        assert ours <= 1.5 * own + 1.0, (mix, ours, own)
        if mix:
            lora = diff(full, plain(adapter_dir, (), seed, prompt, torch.float32))
            assert diff(image, plain(adapter_dir, (), seed, prompt, dtype)) >= 0.5 * lora, mix


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eager_mixed_batch_in_half_precision(adapter_dir, dtype):
    with LoraManager(load_tiny(dtype), make_catalog(adapter_dir), max_batch=4, slots=2) as m:
        assert m.dtype == dtype and m.info("r6_te").has_text_encoder
        check_against_plain_diffusers(adapter_dir, run_together(m), dtype)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_mixed_batch_in_half_precision_never_recompiles(adapter_dir, dtype):
    with LoraManager(load_tiny(dtype), make_catalog(adapter_dir), compile=True, max_batch=4, slots=2) as m:
        with torch._dynamo.config.patch(error_on_recompile=True):
            images = run_together(m)
            alone = m.generate(PROMPTS[2], adapter=list(BATCH[2]), seed=22, output_type="np").image
        assert m.recompiles == 0
        check_against_plain_diffusers(adapter_dir, images, dtype)
        # the two-LoRA request alone runs its LoRAs merged into the weights (rounded once to the dtype), not as a
        # branch: it meets the same bar against float32 plain diffusers as its row of the batch
        mix, seed, prompt = tuple(BATCH[2]), 22, PROMPTS[2]
        full = plain(adapter_dir, mix, seed, prompt, torch.float32)
        assert diff(alone, full) <= 1.5 * diff(plain(adapter_dir, mix, seed, prompt, dtype), full) + 1.0


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_any_cuda_device_gets_the_presets_dtype(device):
    assert resolve_dtype(None, "float16", torch.device(device)) == torch.float16
    assert resolve_dtype(None, "bfloat16", torch.device(device)) == torch.bfloat16


def test_the_cpu_gets_float32_unless_asked_and_names_are_checked():
    cpu = torch.device("cpu")
    assert resolve_dtype(None, "float16", cpu) == torch.float32
    assert resolve_dtype("bfloat16", "float16", cpu) == torch.bfloat16
    assert resolve_dtype(torch.float16, None, torch.device("cuda")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of float16, bfloat16, float32, got 'half'"):
        resolve_dtype("half", None, cpu)
    with pytest.raises(ValueError, match="got torch.int8"):
        resolve_dtype(torch.int8, None, cpu)


def test_from_preset_in_bfloat16_on_the_cpu():
    with LoraManager.from_preset("tiny", device="cpu", dtype="bfloat16") as m:
        assert m.pipe.unet.dtype == m.pipe.text_encoder.dtype == m.pipe.vae.dtype == torch.bfloat16
        result = m.generate(PROMPT, adapter="frame", steps=2)
        assert result.info["dtype"] == "bfloat16" and np.asarray(result.image).std() > 0
