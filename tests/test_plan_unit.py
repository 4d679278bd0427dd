"""hotswap/plan alone: which hotswap slot each adapter of a request goes to, and which adapters a mixed batch keeps
resident on the device, as pure functions of the slots' contents."""

from __future__ import annotations

import pytest

from lora_manager.errors import RequestError
from lora_manager.hotswap.plan import assign_slots, plan_resident

pytestmark = pytest.mark.unit


def test_assign_slots_orders_by_id_and_keeps_fitting_live_adapters_in_place():
    assert assign_slots([None, None], ["b", "a"]) == ["a", "b"]
    assert assign_slots(["a", "b"], ["b", "a"]) == ["a", "b"]  # order in the request does not move anything
    assert assign_slots(["a", "c"], ["b", "c"]) == ["b", "c"]  # c stays; b overwrites a
    assert assign_slots(["a", "b"], ["b", "c"]) == ["b", "c"]  # b must come before c: both move
    assert assign_slots([None, "b", None], ["a", "c"]) == ["a", "c", None]  # two writes: a added, b becomes c
    assert assign_slots(["a", None, "b"], ["c"]) == ["c", None, None]  # two writes, not three; the rest emptied
    assert assign_slots(["a", "b"], []) == [None, None]
    with pytest.raises(RequestError):
        assign_slots(["a"], ["a", "b"])


def test_plan_resident_keeps_needed_adapters_and_evicts_the_least_recently_used():
    used = {"a": 3, "b": 1, "c": 2}
    assert plan_resident(["a", "b", "c"], ["a"], used) == ["a", "b", "c"]  # resident: nothing moves
    assert plan_resident(["a", None, "c"], ["d", "a"], used) == ["a", "d", "c"]  # an empty slot first
    assert plan_resident(["a", "b", "c"], ["d", "e", "a"], used) == ["a", "d", "e"]  # then b (oldest), then c
    with pytest.raises(RequestError, match="3 adapters in one batch but there are 2 device slot"):
        plan_resident(["a", "b"], ["c", "d", "e"], used)
