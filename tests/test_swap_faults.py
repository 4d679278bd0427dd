"""A copy into a slot that fails half way (as a device error or an out-of-memory would): the requests of that call get
the error, the slot is emptied and no record says otherwise, the call's pins are released, and every later request,
for any adapter, gives exactly the image it gave before the fault."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lora_manager import LoraManager
from lora_manager.hotswap.merged import MERGE_MAX_WEIGHTS

from engine_helpers import PROMPT, as_float, load_tiny, make_catalog, run_together

FAULT = "injected device fault"


class HalfCopy:
    """`torch._foreach_copy_` that, once armed, copies the first half of its tensors and raises."""

    def __init__(self):
        self.real, self.armed, self.faults = torch._foreach_copy_, False, 0

    def __call__(self, dst, src, **kwargs):
        if not self.armed:
            return self.real(dst, src, **kwargs)
        self.armed, self.faults = False, self.faults + 1
        self.real(dst[: len(dst) // 2], src[: len(src) // 2], **kwargs)
        raise RuntimeError(FAULT)


@pytest.fixture
def half_copy(monkeypatch) -> HalfCopy:
    fault = HalfCopy()
    monkeypatch.setattr(torch, "_foreach_copy_", fault)
    return fault


def _records_agree(m: LoraManager) -> None:
    """What each slot holds is what the residency says, and the pins are exactly the live adapters."""
    residency = m.residency
    assert [s.weights for s in residency.slots] == [
        m.store.get(a) if a is not None else None for a in residency.holding
    ]
    assert m.store.pinned == residency.live()


def _single(m: LoraManager, half_copy: HalfCopy) -> None:
    requests = [("r4_attn", 1.0), ("r8_kohya", 0.7), ("r7_conv", 1.0), (None, 1.0)]
    before = {r: as_float(m, *r) for r in requests}
    as_float(m, "r4_attn")
    half_copy.armed = True
    with pytest.raises(RuntimeError, match=FAULT):
        as_float(m, "r16_half")  # its copy over r4_attn fails half way
    assert half_copy.faults == 1
    _records_agree(m)
    assert m.residency.holding[0] is None  # emptied, not "still r4_attn"
    for r in [*requests, *reversed(requests)]:
        assert np.array_equal(as_float(m, *r), before[r]), r
    _records_agree(m)


def test_a_failed_copy_loses_nothing_for_single_requests(adapter_dir, half_copy):
    _single(LoraManager(load_tiny(), make_catalog(adapter_dir), slots=1), half_copy)


@torch._dynamo.config.patch(error_on_recompile=True)
def test_a_failed_copy_loses_nothing_on_a_compiled_engine(compiled_manager, half_copy):
    _single(compiled_manager, half_copy)
    assert compiled_manager.recompiles == 0


@pytest.mark.parametrize("merge", [True, False], ids=["merged-weights", "lora-branches"])
def test_a_failed_copy_loses_nothing_for_mixed_batches(adapter_dir, half_copy, merge, monkeypatch):
    if not merge:  # every layer reads the slots' tensors themselves, not the merged weights kept per slot
        monkeypatch.setitem(MERGE_MAX_WEIGHTS, "cpu", 0)
    m = LoraManager(load_tiny(), make_catalog(adapter_dir), slots=2, max_batch=4, device_slots=4)
    batch = [([("r4_attn", 1.0)], 1, PROMPT), ([("r7_conv", 0.8), ("r6_te", 1.0)], 2, PROMPT)]
    later = [([("r8_kohya", 1.0)], 3, PROMPT), ([("r4_attn", 1.0)], 1, PROMPT)]
    before = [r.image for r in run_together(m, batch + later)]
    run_together(m, batch)
    half_copy.armed = True
    other = [([("r16_half", 1.0)], 4, PROMPT), ([("r4_kohya_te", 1.0)], 5, PROMPT)]
    with pytest.raises(RuntimeError, match=FAULT):
        run_together(m, other)
    _records_agree(m)
    for _ in range(2):
        assert all(np.array_equal(r.image, b) for r, b in zip(run_together(m, batch + later), before, strict=True))
    _records_agree(m)
