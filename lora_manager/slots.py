"""Pure planning for hotswap slots: what a request asks for, and which slot each adapter goes to.

A request's adapters are a `Mix`: ordered (adapter id, strength) pairs, empty for the base model. With K slots the
model always runs K LoRA branches; a slot that holds nothing is all zeros (scaling 0), so the output equals plain
diffusers with exactly the requested adapters active.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import RequestError

Mix = tuple[tuple[str, float], ...]


def normalize_mix(adapter, strength: float, slots: int) -> Mix:
    """Turn `None`/'' | 'id' | ['id', ...] | [('id', strength), ...] into a Mix; refuse duplicates and overflow."""
    if adapter is None or adapter == "":
        return ()
    if isinstance(adapter, str):
        return ((adapter, strength),)
    if not isinstance(adapter, (list, tuple)):
        raise RequestError(f"adapter must be an id, a list of ids or of (id, strength) pairs, got {adapter!r}.")
    mix = []
    for entry in adapter:
        if isinstance(entry, str):
            mix.append((entry, strength))
        elif isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str):
            mix.append((entry[0], entry[1]))
        else:
            raise RequestError(f"adapter entries must be an id or an (id, strength) pair, got {entry!r}.")
    mix = [(i, s) for i, s in mix if i]  # an empty id is an unused slot (the app's blank rows)
    ids = [i for i, _ in mix]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise RequestError(f"Adapter {dupes[0]!r} appears twice in one request; give it once with its strength.")
    if len(mix) > slots:
        raise RequestError(
            f"{len(mix)} adapters requested but this engine has {slots} hotswap slot(s); "
            f"start it with slots={len(mix)} (app: --slots {len(mix)})."
        )
    return tuple(mix)


def assign_slots(live: Sequence[str | None], wanted: Sequence[str]) -> list[str | None]:
    """The adapter each slot should hold: wanted adapters already live stay put (no copy); the others fill empty
    slots first, then slots whose adapter is not wanted; every slot left over is emptied."""
    keep = [a if a in wanted else None for a in live]
    missing = [a for a in wanted if a not in keep]
    order = sorted(range(len(live)), key=lambda i: live[i] is not None)  # empty slots before overwritten ones
    free = [i for i in order if keep[i] is None]
    if len(missing) > len(free):
        raise RequestError(f"{len(wanted)} adapters requested but there are {len(live)} hotswap slot(s).")
    for i, adapter in zip(free, missing):
        keep[i] = adapter
    return keep
