"""Hotswap slots: several adapters in one request, each at its own strength, on one template per slot."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from lora_manager import AdapterFormatError, LoraManager, RequestError, UnknownAdapterError
from lora_manager.images import levels

from engine_helpers import (
    assert_same_slots,
    break_while_evicted,
    load_tiny,
    make_catalog,
    mix_reference,
    snapshot_slots,
)
from helpers import PROMPT

# Pairs with different ranks, alphas and target sets: attention-only with attention+ff+conv (ranks 4/7, alphas 4/11),
# a half-alpha rank 16 with a text-encoder adapter, and two kohya files (one with a text-encoder part).
PAIRS = [
    [("r4_attn", 0.7), ("r7_conv", 1.0)],
    [("r16_half", 0.7), ("r6_te", 1.0)],
    [("r8_kohya", 0.7), ("r4_kohya_te", 1.0)],
]
TRIPLE = [("r7_conv", 0.5), ("r6_te", 1.2), ("r8_kohya", 0.8)]


def image(manager: LoraManager, mix, seed: int = 0) -> np.ndarray:
    return manager.generate(PROMPT, adapter=mix, seed=seed, output_type="np").image


def ref(adapter_dir, mix, seed: int = 0) -> np.ndarray:
    return mix_reference([(adapter_dir / f"{i}.safetensors", s) for i, s in mix], seed)


@pytest.fixture(scope="module")
def slots3(adapter_dir) -> LoraManager:
    return LoraManager(load_tiny(), make_catalog(adapter_dir), slots=3)


@pytest.mark.parametrize("mix", PAIRS + [TRIPLE], ids=lambda m: "+".join(i for i, _ in m))
def test_mix_equals_plain_diffusers_set_adapters(slots3, adapter_dir, mix):
    out = image(slots3, mix)
    assert levels(out, ref(adapter_dir, mix)) <= 1
    for adapter_id, strength in mix:  # and it really is a combination, not one of its parts
        assert levels(out, image(slots3, [(adapter_id, strength)])) > 1


def test_a_sequence_of_mixes_reuses_live_slots(slots3, adapter_dir):
    slots3.generate(PROMPT, adapter=None)
    slots3.generate(PROMPT, adapter=PAIRS[0])
    before = slots3.stats()["live"]
    out = image(slots3, [("r7_conv", 0.4), ("r16_half", 1.0)])  # r7_conv is live: only r16_half is copied
    after = slots3.stats()["live"]
    assert after.index("r7_conv") == before.index("r7_conv") and "r16_half" in after and "r4_attn" not in after
    assert levels(out, ref(adapter_dir, [("r7_conv", 0.4), ("r16_half", 1.0)])) <= 1
    swaps = slots3.stats()["swaps"]
    result = slots3.generate(PROMPT, adapter=[("r16_half", 1.0), ("r7_conv", 0.9)])  # same set: strengths only
    assert slots3.stats()["swaps"] == swaps and result.info["swap_ms"] == 0.0
    assert result.info["adapter"] == ["r16_half", "r7_conv"] and result.info["strength"] == [1.0, 0.9]
    assert levels(image(slots3, None), ref(adapter_dir, [])) <= 1  # every slot back to zero


@pytest.mark.slow  # 12 s of generations: out of the inner loop
def test_the_same_request_gives_the_same_bytes_whatever_the_slots_held(slots3):
    """LoRA branches are summed in slot order and float sums depend on order: a request's adapters always sit in
    the order of their ids."""
    mix = [("r4_attn", 0.7), ("r7_conv", 1.0)]
    histories = [
        None,
        [("r7_conv", 1.0)],
        [("r16_half", 1.0), ("r4_attn", 0.5), ("r6_te", 1.0)],
        [("r8_kohya", 1.0), ("r7_conv", 0.3)],
        [("r7_conv", 0.2), ("r6_te", 1.0)],
    ]
    outputs = []
    for history in histories:
        slots3.generate(PROMPT, adapter=history)
        outputs += [image(slots3, mix), image(slots3, mix[::-1])]
    assert all(np.array_equal(outputs[0], out) for out in outputs[1:])


@torch._dynamo.config.patch(error_on_recompile=True)
def test_mixed_requests_on_a_compiled_engine_never_recompile(compiled_manager, adapter_dir):
    m = compiled_manager
    requests = [
        PAIRS[0],
        None,
        [("r7_conv", 0.6)],
        PAIRS[1],
        [("r6_te", 1.0), ("r4_attn", 0.3)],
        PAIRS[2],
        [("r16_half", 1.5)],
        [("r4_kohya_te", 0.7), ("r16_half", 0.2)],
        None,
        PAIRS[0],
    ] * 2 + [TRIPLE[:2]]
    checked = {0: PAIRS[0], 3: PAIRS[1], 5: PAIRS[2], 6: [("r16_half", 1.5)], 8: []}
    for i, mix in enumerate(requests):
        out = image(m, mix)
        if i in checked:
            assert levels(out, ref(adapter_dir, checked[i])) <= 1, (i, mix)
    stats = m.stats()
    assert len(requests) >= 20 and stats["slots"] == 2 and stats["recompiles"] == 0


def test_a_bad_adapter_in_a_mix_leaves_every_slot_bit_identical(adapter_dir, tmp_path):
    """The bad file is found only when an evicted adapter is re-read for a mix: still checked before any write."""
    shutil.copy(adapter_dir / "r4_kohya_te.safetensors", tmp_path / "victim.safetensors")
    catalog = make_catalog(adapter_dir, ("r4_attn", "r7_conv", "r6_te"))
    m = LoraManager(load_tiny(), catalog, slots=2)
    m.register("victim", str(tmp_path / "victim.safetensors"))
    live = [("r4_attn", 0.7), ("r7_conv", 1.0)]
    expected = image(m, live)
    break_while_evicted(m, adapter_dir, tmp_path / "victim.safetensors", ("r4_attn", "r7_conv"))

    snapshot, swaps = snapshot_slots(m), m.stats()["swaps"]
    for bad in ([("r4_attn", 0.7), ("victim", 1.0)], [("victim", 1.0), ("r7_conv", 0.5)]):
        with pytest.raises(AdapterFormatError, match="'victim'.*empty"):
            m.generate(PROMPT, adapter=bad)
    with pytest.raises(UnknownAdapterError):
        m.generate(PROMPT, adapter=[("r4_attn", 0.7), ("nope", 1.0)])
    with pytest.raises(RequestError, match="strength"):
        m.generate(PROMPT, adapter=[("r4_attn", 0.7), ("r6_te", 9.0)])
    assert_same_slots(snapshot, snapshot_slots(m))
    assert m.stats()["swaps"] == swaps and m.stats()["live"] == ["r4_attn", "r7_conv"]
    assert np.array_equal(image(m, live), expected)
