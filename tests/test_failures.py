"""Every refused adapter: its own error naming the problem and the fix; the live adapter bit-identical; no recompile."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lora_manager import (
    AdapterFormatError,
    AdapterIncompatibleError,
    AdapterSourceError,
    AdapterValueError,
    CacheBudgetError,
    LoraManager,
)
from lora_manager.adapters.inspection import ATTENTION as ATTN
from lora_manager.testing import rewrite, write_adapter

from engine_helpers import (
    as_float,
    assert_same_image,
    assert_same_slots,
    load_tiny,
    make_catalog,
    one,
    reference,
    snapshot_slots,
)

LIVE = ([("r7_conv", 0.8), ("r6_te", 0.5)], 1.0)  # both slots of the compiled engine in use, text encoder too


def _first(tensors, fragment):
    return next(k for k in sorted(tensors) if fragment in k)


def _bad_files(pipe, base, folder):
    """name -> (file, expected error class, a distinctive part of the message)."""
    f = folder
    return {
        "target outside the template": (
            write_adapter(pipe, f / "time.safetensors", rank=4, alpha=4, suffixes=("time_emb_proj",)),
            AdapterIncompatibleError,
            "outside the hotswap template",
        ),
        "rank above target_rank": (
            write_adapter(pipe, f / "r32.safetensors", rank=32, alpha=32, suffixes=ATTN),
            AdapterIncompatibleError,
            "rank 32 .* > target_rank 16: restart with --target-rank 32",
        ),
        "lora_A with the wrong input size": (
            rewrite(
                base,
                f / "wide.safetensors",
                lambda t, m: t.update(
                    {_first(t, "to_q.lora_A"): torch.zeros(4, t[_first(t, "to_q.lora_A")].shape[1] + 8)}
                ),
            ),
            AdapterIncompatibleError,
            "made for another base model",
        ),
        "a module this base model lacks": (
            rewrite(base, f / "other.safetensors", _move_first_block),
            AdapterIncompatibleError,
            "does not exist in this base model",
        ),
        "NaN values": (
            rewrite(
                base, f / "nan.safetensors", lambda t, m: t[_first(t, "lora_B")].view(-1).__setitem__(0, float("nan"))
            ),
            AdapterValueError,
            "NaN or Inf",
        ),
        "Inf values": (
            rewrite(
                base, f / "inf.safetensors", lambda t, m: t[_first(t, "lora_A")].view(-1).__setitem__(3, float("inf"))
            ),
            AdapterValueError,
            "NaN or Inf",
        ),
        "DoRA": (
            rewrite(
                base,
                f / "dora.safetensors",
                lambda t, m: t.update(
                    {_first(t, "to_q.lora_A").replace("lora_A.weight", "lora_magnitude_vector"): torch.ones(8)}
                ),
            ),
            AdapterFormatError,
            "DoRA adapter",
        ),
        "LoKr": (
            rewrite(base, f / "lokr.safetensors", lambda t, m: t.update({"lora_unet_x.lokr_w1": torch.ones(2, 2)})),
            AdapterFormatError,
            "lokr adapter",
        ),
        "LoHa": (
            rewrite(base, f / "loha.safetensors", lambda t, m: t.update({"lora_unet_x.hada_w1_a": torch.ones(2, 2)})),
            AdapterFormatError,
            "loha adapter",
        ),
        "LoRA bias": (
            rewrite(
                base,
                f / "bias.safetensors",
                lambda t, m: t.update(
                    {
                        _first(t, "to_q.lora_B").replace(".weight", ".bias"): torch.zeros(
                            t[_first(t, "to_q.lora_B")].shape[0]
                        )
                    }
                ),
            ),
            AdapterFormatError,
            "LoRA bias",
        ),
        "truncated file": (_truncate(base, f / "trunc.safetensors"), AdapterFormatError, "truncated"),
        "corrupt header": (
            _write(f / "corrupt.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!}"),
            AdapterFormatError,
            "corrupt header",
        ),
        "empty file": (_write(f / "empty.safetensors", b""), AdapterFormatError, "empty"),
        "pickle file": (_write(f / "weights.bin", b"\x80\x04K\x01."), AdapterSourceError, "pickle file"),
        "missing file": (f / "missing.safetensors", AdapterSourceError, "no such file"),
    }


def _move_first_block(tensors, metadata):
    """Rename down_blocks.1 to down_blocks.7, a block the tiny UNet does not have (as an SDXL LoRA would)."""
    for key in [k for k in tensors if "down_blocks.1." in k]:
        tensors[key.replace("down_blocks.1.", "down_blocks.7.")] = tensors.pop(key)


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def _truncate(src, dst):
    data = src.read_bytes()
    return _write(dst, data[: len(data) - 100])


@pytest.fixture(scope="module")
def bad(compiled_manager, adapter_dir, tmp_path_factory):
    return _bad_files(load_tiny(), adapter_dir / "r4_attn.safetensors", tmp_path_factory.mktemp("bad"))


@pytest.fixture(scope="module")
def live_output(compiled_manager):
    return as_float(compiled_manager, *LIVE)


CASES = [
    "target outside the template",
    "rank above target_rank",
    "lora_A with the wrong input size",
    "a module this base model lacks",
    "NaN values",
    "Inf values",
    "DoRA",
    "LoKr",
    "LoHa",
    "LoRA bias",
    "truncated file",
    "corrupt header",
    "empty file",
    "pickle file",
    "missing file",
]


@pytest.mark.parametrize("case", CASES)
@torch._dynamo.config.patch(error_on_recompile=True)
def test_refused_adapter_leaves_live_adapter_bit_identical(case, bad, compiled_manager, live_output):
    m = compiled_manager
    path, error, text = bad[case]
    snapshot, recompiles = snapshot_slots(m), m.recompiles
    with pytest.raises(error, match=text) as info:
        m.register("bad", str(path))
    assert "'bad'" in str(info.value) and info.value.adapter_id == "bad"
    assert "bad" not in {a.id for a in m.adapters()}
    assert_same_slots(snapshot, snapshot_slots(m))
    assert np.array_equal(as_float(m, *LIVE), live_output)  # the next request is served exactly as before
    assert m.recompiles == recompiles == 0


def test_adapter_larger_than_the_cache_budget_is_refused(compiled_manager, adapter_dir, live_output, monkeypatch):
    m = compiled_manager
    monkeypatch.setattr(m.store, "budget_bytes", m.info("r7_conv").bytes + 1000)
    with pytest.raises(CacheBudgetError, match="raise cache_bytes"):
        m.register("big", str(adapter_dir / "r16_half.safetensors"))
    monkeypatch.undo()
    assert np.array_equal(as_float(m, *LIVE), live_output)


def test_dropout_in_the_config_is_served_like_plain_diffusers(adapter_dir, tmp_path):
    """lora_dropout is identity at inference, so unlike diffusers' hotswap we accept it rather than refuse it.

    Plain diffusers leaves PEFT's new dropout modules in training mode (two runs differ); the reference calls eval().
    The adapter is registered on an engine of its own: the session's engines stay as every other test expects them.
    """

    def add_dropout(t, meta):  # diffusers keeps each component's LoraConfig under "<component>.<field>"
        cfg = json.loads(meta["lora_adapter_metadata"])
        meta["lora_adapter_metadata"] = json.dumps({**cfg, "unet.lora_dropout": 0.1, "text_encoder.lora_dropout": 0.1})

    path = rewrite(adapter_dir / "r6_te.safetensors", tmp_path / "dropout.safetensors", add_dropout)
    m = LoraManager(load_tiny(), make_catalog(adapter_dir, ("r6_te",)))
    m.register("dropout", str(path))
    assert_same_image(as_float(m, "dropout"), reference(path))


def test_resident_memory_stays_flat_over_1000_swaps(manager):
    """No swap allocates: plans are built once per adapter and every write lands in the template's own tensors."""

    def rss() -> int:  # current resident pages (Linux /proc), not the peak that `resource` reports
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1])

    cycle = ["r4_attn", "r7_conv", None, "r16_half", "r6_te", "r4_kohya_te"]
    with manager._lock:
        for i in range(120):  # warm-up: every plan built, allocator settled
            manager.residency.make_resident([one(cycle[i % len(cycle)], 1.0)])
        before = rss()
        for i in range(1000):
            manager.residency.make_resident([one(cycle[i % len(cycle)], 0.5 + (i % 3) / 2)])
        after = rss()
    assert after <= before * 1.05, f"resident pages grew from {before} to {after}"
