"""The engine against plain diffusers: same images after any sequence of swaps, no recompiles, nothing lost."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from lora_manager import LoraManager, RequestError, UnknownAdapterError

from engine_helpers import ADAPTERS, as_float, assert_same_image, load_tiny, make_catalog, reference
from helpers import PROMPT

# Each step is (adapter, strength); the sequence revisits adapters after others of other ranks and targets.
SEQUENCE = [
    ("r4_attn", 1.0),
    ("r7_conv", 1.0),
    ("r16_half", 0.5),
    ("r8_kohya", 1.0),
    ("r6_te", 1.0),
    (None, 1.0),
    ("r4_kohya_te", 0.7),
    ("r4_attn", 1.0),
    ("r6_te", 1.3),
    ("r7_conv", 0.8),
    ("r16_half", 1.0),
]


@pytest.fixture(scope="module")
def references(adapter_dir):
    cache = {}

    def get(adapter, strength):
        if (adapter, strength) not in cache:
            path = None if adapter is None else adapter_dir / f"{adapter}.safetensors"
            cache[(adapter, strength)] = reference(path, strength)
        return cache[(adapter, strength)]

    return get


def test_every_adapter_changes_the_image(references):
    base = references(None, 1.0)
    for name in ADAPTERS:
        assert np.abs(references(name, 1.0) - base).max() > 0.02, name


def test_swaps_match_plain_diffusers_after_any_sequence(manager, references):
    for adapter, strength in SEQUENCE:
        assert_same_image(as_float(manager, adapter, strength), references(adapter, strength))


def test_a_swap_leaves_exactly_the_new_adapter_in_the_template(manager):
    """After any swap each module holds the adapter's own A and B and zeros above its rank, and a module it does not
    target holds zeros: a swap zeroes only what the previous adapter wrote, so nothing of it may remain."""
    slot = manager.residency.slots[0]
    for adapter in ("r16_half", "r4_attn", "r7_conv", "r16_half", "r6_te", "r4_kohya_te", "r8_kohya"):
        manager.generate(PROMPT, adapter=adapter, steps=1)
        held = manager.store.get(adapter).modules
        for key, live in slot.modules.items():
            m = held.get(key)
            r = m.rank if m is not None else 0
            if m is not None:
                assert torch.equal(live.A[:r], m.A.to(live.A.dtype)) and torch.equal(
                    live.B[:, :r], m.B.to(live.B.dtype)
                )
            assert not live.A[r:].any() and not live.B[:, r:].any(), (adapter, key)
            assert m is not None or float(live.scaling) == 0.0


def test_an_engine_whose_adapters_skip_the_text_encoder_starts_without_notices(adapter_dir):
    """The zero template then has no text-encoder keys, which diffusers would report for every slot it loads."""
    import logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    records, logger = Records(), logging.getLogger("diffusers")  # diffusers' loggers do not propagate to the root
    logger.addHandler(records)
    try:
        with LoraManager(load_tiny(), make_catalog(adapter_dir, ("r4_attn", "r7_conv")), max_batch=2) as m:
            assert {comp for comp, _ in m.residency.template_keys} == {"unet"}
            m.generate(PROMPT, adapter="r4_attn", steps=1)
    finally:
        logger.removeHandler(records)
    assert not [m for m in records.messages if "No LoRA keys" in m], records.messages


def test_adapter_info_is_read_from_the_files(manager):
    info = {a.id: a for a in manager.adapters()}
    assert set(info) == set(ADAPTERS)
    for name, kw in ADAPTERS.items():
        assert info[name].rank == max(kw["rank"], kw.get("te_rank") or 0), name
        assert info[name].format == ("kohya" if kw.get("kohya") else "peft"), name
        assert info[name].has_text_encoder == bool(kw.get("te_rank")), name
    assert info["r4_attn"].alpha == 4 and info["r7_conv"].alpha == 11 and info["r16_half"].alpha == 8
    assert info["r7_conv"].num_modules > info["r4_attn"].num_modules  # attention + ff + conv vs attention only
    assert manager.target_rank == 16


def test_strength_rescales_in_place(manager, references):
    manager.generate(PROMPT, adapter="r6_te", strength=1.0)
    swaps = manager.stats()["swaps"]
    result = manager.generate(PROMPT, adapter="r6_te", strength=1.3, output_type="np")
    assert manager.stats()["swaps"] == swaps and result.info["swap_ms"] == 0.0
    assert_same_image(result.image, references("r6_te", 1.3))


def test_info_reproduces_with_plain_diffusers(manager, adapter_dir):
    manager.generate(PROMPT, adapter="r4_attn", steps=1)  # another adapter live: the request below swaps
    swaps = manager.stats()["swaps"]
    result = manager.generate(PROMPT, adapter="r8_kohya", strength=1.0, seed=7, output_type="np")
    info = result.info
    assert {"adapter", "strength", "seed", "num_inference_steps", "guidance_scale", "height", "width"} <= set(info)
    assert info["adapter"] == "r8_kohya" and info["generate_ms"] > 0
    assert manager.stats()["swaps"] == swaps + 1 and info["swap_ms"] == manager.stats()["swap_ms_last"] > 0
    again = manager.generate(PROMPT, adapter="r8_kohya", strength=1.0, seed=7, steps=1).info
    assert again["swap_ms"] == 0.0 and manager.stats()["swaps"] == swaps + 1  # already live: no swap, no time
    assert_same_image(result.image, reference(adapter_dir / "r8_kohya.safetensors", 1.0, seed=info["seed"]))


def test_cache_budget_evicts_but_never_the_live_adapter(adapter_dir, references):
    names = ("r4_attn", "r16_half", "r7_conv")
    probe = LoraManager(load_tiny(), make_catalog(adapter_dir, names))
    sizes = {a.id: a.bytes for a in probe.adapters()}
    budget = sizes["r16_half"] + sizes["r7_conv"] + 1  # room for two of the three
    m = LoraManager(load_tiny(), make_catalog(adapter_dir, names), cache_bytes=budget)
    for name in ("r7_conv", "r16_half", "r4_attn", "r7_conv", "r16_half"):
        out = as_float(m, name)
        assert name in m.store, "the live adapter must stay held (cached, or beside the cache while live)"
        assert m.store.nbytes <= budget
        assert_same_image(out, references(name, 1.0))
    assert m.stats()["cache_evictions"] > 0 and m.stats()["cache_misses"] > 0


def test_unknown_adapter_and_out_of_range_requests(manager):
    with pytest.raises(UnknownAdapterError, match="Unknown adapter 'nope'"):
        manager.generate(PROMPT, adapter="nope")
    for kw, field in [({"strength": 5.0}, "strength"), ({"seed": -1}, "seed"), ({"steps": 0}, "steps")]:
        with pytest.raises(RequestError, match=field):
            manager.generate(PROMPT, adapter="r4_attn", **kw)


@torch._dynamo.config.patch(error_on_recompile=True)
def test_compiled_swaps_never_recompile(compiled_manager, references):
    steps = SEQUENCE + [("r4_kohya_te", 1.0), ("r4_kohya_te", 0.4), ("r8_kohya", 1.5)] + SEQUENCE[:8]
    assert len(steps) >= 20
    checked = 0
    for adapter, strength in steps:
        out = as_float(compiled_manager, adapter, strength)
        if (adapter, strength) in dict.fromkeys(SEQUENCE[:6]):
            assert_same_image(out, references(adapter, strength))
            checked += 1
    stats = compiled_manager.stats()
    assert stats["compiled"] and stats["recompiles"] == 0 and stats["compile_s"] > 0
    assert checked >= 6


def test_a_prompt_longer_than_the_tokenizer_reads_is_flagged(manager):
    long = " ".join(["a red circle on a blue background"] * 4)
    assert manager.generate(long, steps=1).info["prompt_truncated"] is True
    assert manager.generate(PROMPT, steps=1).info["prompt_truncated"] is False


def test_the_engine_provides_the_interface_the_app_is_written_against(manager):
    from lora_manager.serving.protocol import Engine

    assert isinstance(manager, Engine)
    assert manager.max_adapters == len(manager.residency.mix_slots)
    assert list(manager.startup_s) == ["adapter_reads", "template"]  # eager, built from a pipeline


def test_start_up_phases_are_timed_in_order_within_the_construction(adapter_dir):
    pipe, catalog = load_tiny(), make_catalog(adapter_dir)
    t0 = time.perf_counter()
    with LoraManager(pipe, catalog) as m:
        wall = time.perf_counter() - t0
        assert list(m.startup_s) == ["adapter_reads", "template"]
        assert all(s > 0 for s in m.startup_s.values()) and sum(m.startup_s.values()) <= wall, (m.startup_s, wall)


@pytest.mark.parametrize("content", [None, b"garbage", b""])
def test_a_missing_or_broken_aot_package_is_refused_with_its_reason(adapter_dir, tmp_path, content):
    from lora_manager import LoraManagerError

    path = tmp_path / "unet.pt2"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(LoraManagerError, match="no such file" if content is None else "cannot be loaded"):
        LoraManager(load_tiny(), make_catalog(adapter_dir), aot_package=path)


def test_a_swap_waits_for_the_device_once_however_many_slots_it_loads(adapter_dir, monkeypatch):
    """On CUDA each wait is a device-wide synchronize: a request that brings in two adapters waits once, not twice."""
    from lora_manager.hotswap import residency

    waits = []
    monkeypatch.setattr(residency, "sync", lambda device: waits.append(device))
    with LoraManager(load_tiny(), make_catalog(adapter_dir, ("r4_attn", "r7_conv")), slots=2) as m:
        m.generate(PROMPT, adapter=["r4_attn", "r7_conv"], steps=1)
        assert len(waits) == 1
        m.generate(PROMPT, adapter=[["r4_attn", 0.5], ["r7_conv", 1.0]], steps=1)  # strengths only: no copy
        assert len(waits) == 1


def test_a_packed_adapter_is_one_buffer_counted_as_the_cuda_host_allocator_holds_it(manager):
    """Pinned, every tensor of an adapter is a view of one buffer (one host allocation, not one per tensor), and
    the cache counts that buffer rounded up to a power of two, as CUDA's caching host allocator pins it."""
    from lora_manager.adapters.store import ALIGN, held_bytes, packed

    weights = manager.store.get("r6_te")
    one = packed(weights, pin_memory=False)
    tensors = [t for m in one.modules.values() for t in (m.A, m.B)]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert all(t.storage_offset() * t.element_size() % ALIGN == 0 for t in tensors)
    for key, m in weights.modules.items():
        assert torch.equal(one.modules[key].A, m.A) and torch.equal(one.modules[key].B, m.B)
    size = tensors[0].untyped_storage().nbytes()
    held = held_bytes(weights, pinned=True)
    assert held >= size > held // 2 and held & (held - 1) == 0
    assert held_bytes(weights, pinned=False) == weights.nbytes


def test_unregister_forgets_an_adapter_and_keeps_the_others_serving(adapter_dir, references):
    with LoraManager(load_tiny(), make_catalog(adapter_dir, ("r4_attn", "r7_conv", "r6_te"))) as m:
        m.register("extra", str(adapter_dir / "r4_kohya_te.safetensors"))
        m.generate(PROMPT, adapter="extra", steps=1)
        m.generate(PROMPT, adapter="r4_attn", steps=1)  # "extra" is no longer live
        m.unregister("extra")
        assert "extra" not in {a.id for a in m.adapters()} and "extra" not in m.store
        with pytest.raises(UnknownAdapterError, match="Unknown adapter 'extra'"):
            m.generate(PROMPT, adapter="extra")
        assert_same_image(as_float(m, "r7_conv"), references("r7_conv", 1.0))
