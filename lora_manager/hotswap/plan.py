"""Pure planning for hotswap slots: which slot each adapter of a request (or of a mixed batch) goes to.

A request's adapters are a `Mix` (see `request_schema`). With K slots the model always runs K LoRA branches, added to
the layer's output in slot order; a slot that holds nothing is all zeros (scaling 0) and adds exactly 0, so the
output equals plain diffusers with exactly the requested adapters active.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

from ..errors import RequestError
from ..request_schema import Mix

__all__ = ["Mix", "assign_slots", "plan_resident"]


def assign_slots(live: Sequence[str | None], wanted: Sequence[str]) -> list[str | None]:
    """The adapter each slot should hold. The wanted adapters sit in slots in the order of their ids, so one request
    sums its LoRA branches in the same order whatever the slots held before (float sums depend on order: the same
    request gives the same bytes); among such placements the one that rewrites the fewest slots wins, so adapters
    already live in a fitting slot stay put (no copy). Every slot left over is emptied."""
    ordered = sorted(wanted)
    if len(ordered) > len(live):
        raise RequestError(
            f"{len(ordered)} adapters requested but there are {len(live)} hotswap slot(s).", field="adapter"
        )
    best: list[str | None] | None = None
    for places in combinations(range(len(live)), len(ordered)):
        plan: list[str | None] = [None] * len(live)
        for i, adapter in zip(places, ordered, strict=True):
            plan[i] = adapter
        if best is None or _writes(live, plan) < _writes(live, best):
            best = plan
    return best


def _writes(live: Sequence[str | None], plan: Sequence[str | None]) -> int:
    return sum(a != b for a, b in zip(live, plan, strict=True))


def plan_resident(live: Sequence[str | None], needed: Sequence[str], last_used: dict[str, int]) -> list[str | None]:
    """For mixed batches (each row picks its own slots, so placement does not change any sum): the adapter each
    device slot should hold. Needed adapters already resident stay where they are (no copy); each incoming one takes
    an empty slot, else the slot of the least recently used adapter the batch does not need. The rest stay resident,
    ready for later batches."""
    incoming = [a for a in dict.fromkeys(needed) if a not in live]
    empty = [i for i, a in enumerate(live) if a is None]
    spare = sorted(
        (i for i, a in enumerate(live) if a is not None and a not in needed), key=lambda i: last_used.get(live[i], -1)
    )
    if len(incoming) > len(empty) + len(spare):
        raise RequestError(
            f"{len(set(needed))} adapters in one batch but there are {len(live)} device slot(s).", field="adapter"
        )
    plan = list(live)
    for adapter, i in zip(incoming, empty + spare, strict=False):
        plan[i] = adapter
    return plan
