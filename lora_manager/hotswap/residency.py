"""What the device holds: which adapter each device slot's template tensors carry, and the one transactional step
that makes a batch's adapters resident (or, for an adapter refused on its way in, changes nothing for it).

Two layouts share that step (`Layout.mixed`). Without mixed batches a request's adapters fill the first slots, in
the order of their ids, each at its strength (`plan.assign_slots`), and every other slot is emptied. With mixed
batches every row of a pipeline call picks its own device slots (`rows.BatchRows`): the batch's adapters become
resident beside those already there (`plan.resident`), and each row's picks and strengths are written after.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..adapters.reader import AdapterWeights
from ..adapters.registry import AdapterRegistry
from ..layout import Layout
from ..request_schema import Mix
from .fusion import Fusion, Picks, unsupported
from .plan import assign_slots, plan_resident
from .rows import BatchRows
from .slot import DevicePrefetch, sync
from .template import prepare_template


@dataclass
class Swap:
    """What one `make_resident` did: its milliseconds (0 when nothing was copied) and the refused adapters."""

    ms: float = 0.0
    refused: dict[str, Exception] = field(default_factory=dict)

    def runs(self, adapter_ids: frozenset[str]) -> bool:
        """Whether a request naming `adapter_ids` can run: none of them was refused."""
        return not self.refused.keys() & adapter_ids

    def error(self, adapter_ids: frozenset[str]) -> Exception:
        return self.refused[min(self.refused.keys() & adapter_ids)]


class Residency:
    """Owns the hotswap template's device slots and what each holds. Only the engine's lock holder calls it.

    The registry gives each adapter's checked weights (from the CPU cache, or read again); its CPU cache pins what is
    resident so that it is never evicted.
    """

    def __init__(
        self,
        pipe,
        components: dict[str, torch.nn.Module],
        keys: set[tuple[str, str]],
        rank: int,
        layout: Layout,
        registry: AdapterRegistry,
        fuse: bool = True,
    ):
        self.layout = layout
        self.rows = BatchRows(layout.max_batch, layout.mix_slots, pipe.device) if layout.mixed else None
        self.slots = prepare_template(pipe, components, keys, rank, layout.device_slots, self.rows)  # every device slot
        self.mix_slots = self.slots[: layout.mix_slots]  # the slots one request's adapters combine in
        self.holding: list[str | None] = [None] * layout.device_slots  # the adapter id each device slot holds
        self.swap_ms: list[float] = []
        self._device = pipe.device
        self._store, self._fetch = registry.store, registry.weights
        mixed_on_cuda = layout.mixed and pipe.device.type == "cuda"
        self._prefetch = DevicePrefetch(pipe.device, layout.device_slots) if mixed_on_cuda else None
        # a call whose rows all run the same adapters runs them merged into the base weights (`fusion`)
        layers = {k: components[k[0]].get_submodule(k[1]) for k in self.slots[0].modules}
        self.unfused = "turned off (fuse=False)" if not fuse else unsupported(layers)
        self.fusion = Fusion(components, self.slots) if self.unfused is None else None
        self._last_used: dict[str, int] = {}  # adapter id -> the batch that last needed it (evict the oldest)
        self._batches = 0

    @property
    def template_keys(self) -> frozenset[tuple[str, str]]:
        return frozenset(self.slots[0].modules)

    def live(self) -> frozenset[str]:
        return frozenset(filter(None, self.holding))

    def report(self) -> dict[str, Any]:
        """What the device holds and what swapping cost, for the engine's `stats()`."""
        swap_ms = self.swap_ms
        return {
            "live": list(self.holding),
            "swaps": len(swap_ms),
            "swap_ms_last": swap_ms[-1] if swap_ms else None,
            "swap_ms_median": statistics.median(swap_ms) if swap_ms else None,
            "slots": len(self.mix_slots),
            "device_slots": len(self.slots),
            "template_modules": len(self.slots[0].modules),
        } | (self.fusion.report() if self.fusion is not None else {"fused": False, "fused_off": self.unfused})

    def make_resident(self, mixes: list[Mix]) -> Swap:
        """Make the adapters of `mixes` (one per request of the coming pipeline call) resident. Every incoming
        adapter is read and checked before the first write; one that is refused is returned with its error and
        changes nothing: the requests that named it fail, the others run."""
        before = self.live()
        needed = list(dict.fromkeys(a for mix in mixes for a, _ in mix))
        fetched, refused = self._fetch_all([a for a in needed if a not in before])
        runnable = [mix for mix in mixes if not refused.keys() & {a for a, _ in mix}]
        wanted = list(dict.fromkeys(a for mix in runnable for a, _ in mix))
        try:
            targets, strengths = self._plan(runnable, wanted)
        except BaseException:
            self._unpin(fetched.keys())
            raise
        try:
            ms = self._write(targets, fetched, strengths) if runnable else 0.0
        except BaseException:  # a slot that failed part way was emptied: nothing records what it no longer holds
            self._unpin((before | fetched.keys()) - self.live())
            raise
        self._unpin((before | fetched.keys()) - set(targets))
        if self.layout.mixed:
            self._write_rows(runnable, wanted)
        if self.fusion is not None and runnable:
            self.fusion.run(self._fused_picks(runnable))
        return Swap(ms, refused)

    def _fused_picks(self, runnable: list[Mix]) -> Picks | None:
        """The (device slot, strength factor) every row of the call runs, when all rows run the same mix; else None.
        Without mixed batches a slot's scaling already holds its strength (factor 1)."""
        mixes = {tuple(sorted(mix)) for mix in runnable}
        if len(mixes) > 1:
            return None
        slot_of = {a: i for i, a in enumerate(self.holding) if a is not None}
        return tuple((slot_of[a], s if self.layout.mixed else 1.0) for a, s in mixes.pop())

    def _plan(self, runnable: list[Mix], wanted: list[str]) -> tuple[list[str | None], dict[str, float]]:
        """The adapter each device slot should hold, and the strength each loads at."""
        if not self.layout.mixed:  # one request: exactly its adapters in the first slots, each at its strength
            strengths = dict(runnable[0]) if runnable else {}
            return (assign_slots(self.holding, list(strengths)) if runnable else list(self.holding)), strengths
        targets = plan_resident(self.holding, wanted, self._last_used)  # rows pick slots: loads at strength 1
        return targets, dict.fromkeys(filter(None, targets), 1.0)

    def _unpin(self, adapter_ids) -> None:
        for adapter_id in adapter_ids:
            self._store.unpin(adapter_id)

    def _fetch_all(self, incoming: list[str]) -> tuple[dict[str, AdapterWeights], dict[str, Exception]]:
        """Each incoming adapter's weights, pinned so fetching the next one cannot evict it; a refused one's error
        instead. Anything else (an interrupt) unpins what was fetched and propagates."""
        fetched: dict[str, AdapterWeights] = {}
        refused: dict[str, Exception] = {}
        try:
            for adapter_id in incoming:
                try:
                    fetched[adapter_id] = self._fetch(adapter_id)
                except Exception as e:  # noqa: BLE001 - the error is this adapter's requests' answer
                    refused[adapter_id] = e
                    continue
                self._store.pin(adapter_id)
        except BaseException:
            self._unpin(fetched)
            raise
        return fetched, refused

    def _write(
        self, targets: list[str | None], fetched: dict[str, AdapterWeights], strengths: dict[str, float]
    ) -> float:
        """Load every slot whose adapter changes (an adapter that moves to another slot comes from the one it
        leaves), rescale those that stay at a new strength, and wait once for the copies."""
        held = {a: slot.weights for a, slot in zip(self.holding, self.slots, strict=True) if a is not None}
        t0, swapped = time.perf_counter(), False
        for i, (slot, old, new) in enumerate(zip(self.slots, self.holding, targets, strict=True)):
            strength = strengths.get(new, 0.0)
            if new == old:
                if new is not None and strength != slot.strength:
                    slot.set_strength(strength)
                continue
            weights = fetched[new] if new in fetched else held.get(new)
            staged = self._prefetch.take(new, weights) if self._prefetch is not None and new in fetched else None
            try:
                slot.load(weights, strength, staged)
            except BaseException:  # the slot may hold part of each adapter: empty it, and say so
                self.holding[i] = None
                slot.clear()
                raise
            self.holding[i], swapped = new, True
        if not swapped:
            return 0.0
        sync(self._device)
        ms = (time.perf_counter() - t0) * 1e3
        self.swap_ms.append(ms)
        return ms

    def _write_rows(self, runnable: list[Mix], wanted: list[str]) -> None:
        """Mixed batches: write every row's picks, planned per layer for what the slots hold (`BatchRows.write`)."""
        self._batches += 1
        self._last_used.update(dict.fromkeys(wanted, self._batches))
        slot_of = {a: i for i, a in enumerate(self.holding) if a is not None}
        if runnable:
            rows = [[(slot_of[a], s) for a, s in sorted(mix)] for mix in runnable]
            self.rows.write(rows, self.slots)

    def stage(self, upcoming: list[str]) -> None:
        """CUDA, mixed batches: start copying the adapters queued requests need and the device does not hold
        (pinned host memory, side stream), while this batch runs."""
        if self._prefetch is None:
            return
        wanted = {}
        for adapter_id in upcoming:
            if adapter_id not in self.holding and adapter_id in self._store:
                wanted[adapter_id] = self._store.get(adapter_id)
        self._prefetch.stage(wanted)

    def forget(self, weights: AdapterWeights) -> None:
        """An adapter left the CPU cache: drop the swap plans built for it."""
        for slot in self.slots:
            slot.forget(weights)

    def values_per_adapter(self) -> int:
        """How many values the template holds for one adapter at its rank, over every module."""
        return sum(m.A.numel() + m.B.numel() for m in self.slots[0].modules.values())
