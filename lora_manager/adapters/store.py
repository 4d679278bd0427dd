"""A byte-bounded cache of adapters held in CPU memory that keeps the often requested ones (TinyLFU admission, see
`admission.py`); the live adapters are pinned and never evicted, the queued ones are evicted only to register one.

A newcomer that would push out adapters requested at least as often is not kept: while it is pinned (live on the
device) it is held as a guest, outside the budget (at most one per device slot), and dropped when it leaves the device.

With `pin_memory` (CUDA), each adapter is packed into one page-locked buffer, and its cost is what CUDA's host
allocator really holds for it: the buffer rounded up to a power of two. One buffer per adapter rather than one per
tensor, since the allocator rounds every allocation up on its own (a few hundred small tensors would each round up)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..errors import CacheBudgetError
from .admission import Entry, FrequencySketch, choose_victims
from .reader import AdapterWeights


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected: int = 0  # newcomers not kept: every room-making victim was requested at least as often
    worker_reads: int = 0  # misses read on the scheduler's worker while its batch waited (not loaded in the background)


class AdapterStore:
    """CPU-side adapter cache. With `pin_memory`, tensors are page-locked so host-to-GPU copies run async."""

    def __init__(
        self,
        budget_bytes: int,
        pin_memory: bool = False,
        on_evict: Callable[[str, AdapterWeights], None] | None = None,
    ):
        self.budget_bytes = budget_bytes
        self.pin_memory = pin_memory
        self.on_evict = on_evict
        self.stats = StoreStats()
        self.sketch = FrequencySketch()
        self.protected: frozenset[str] = frozenset()  # adapters queued requests need: evicted only to register one
        self._entries: OrderedDict[str, AdapterWeights] = OrderedDict()  # least recently used first
        self._held: dict[str, int] = {}  # host bytes each entry holds
        self._pinned: set[str] = set()
        self._guests: dict[str, AdapterWeights] = {}  # pinned newcomers that were not admitted

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._entries or adapter_id in self._guests

    def record(self, adapter_id: str) -> None:
        """Count a request for the adapter (cached or not): what admission and eviction compare."""
        self.sketch.record(adapter_id)

    def report(self) -> dict[str, int]:
        """The cache's part of the engine's `stats()`."""
        return {
            "cache_entries": len(self._entries),
            "cache_bytes": self.nbytes,
            "cache_budget_bytes": self.budget_bytes,
            "cache_hits": self.stats.hits,
            "cache_misses": self.stats.misses,
            "cache_evictions": self.stats.evictions,
            "cache_rejected": self.stats.rejected,
            "cache_guests": len(self._guests),
            "worker_reads": self.stats.worker_reads,
        }

    @property
    def nbytes(self) -> int:
        """Host memory the cached adapters hold (page-locked: as the allocator rounds it); guests are not counted."""
        return sum(self._held.values())

    def entries(self) -> list[str]:
        return list(self._entries)

    def get(self, adapter_id: str) -> AdapterWeights | None:
        weights = self._entries.get(adapter_id)
        if weights is None:
            weights = self._guests.get(adapter_id)
        if weights is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        if adapter_id in self._entries:
            self._entries.move_to_end(adapter_id)
        return weights

    def check_fits(self, adapter_id: str, weights: AdapterWeights) -> None:
        """Raise before anything is evicted if the adapter cannot fit beside the pinned (live) ones."""
        self._check_room(adapter_id, held_bytes(weights, self.pin_memory))

    def _check_room(self, adapter_id: str, nbytes: int) -> None:
        held, pins = dict(self._held), set(self._pinned)  # copies: a background read checks while the worker puts
        pinned = sum(held[i] for i in pins if i in held and i != adapter_id)
        if nbytes + pinned > self.budget_bytes:
            raise CacheBudgetError(
                f"Adapter {adapter_id!r} needs {nbytes / 2**20:.1f} MiB but the CPU cache budget is "
                f"{self.budget_bytes / 2**20:.1f} MiB ({pinned / 2**20:.1f} MiB held by the live adapter); "
                "raise cache_bytes (--cache-mb).",
                adapter_id,
            )

    def put(self, adapter_id: str, weights: AdapterWeights, always: bool = False) -> AdapterWeights:
        """Insert (pinning host memory if asked), evicting the coldest unpinned entries to make room; a newcomer
        colder than a victim it needs is returned unkept, held as a guest until unpinned. `always` (a registration)
        keeps it whatever the victims' counts."""
        held = held_bytes(weights, self.pin_memory)
        self._check_room(adapter_id, held)
        if adapter_id in self._entries:
            self._drop(adapter_id)
        self._guests.pop(adapter_id, None)
        victims = self._victims(adapter_id, held, always)
        if victims is None:
            self.stats.rejected += 1
            self._guests[adapter_id] = weights
            return weights
        for victim in victims:
            self._drop(victim)
            self.stats.evictions += 1
        if self.pin_memory:
            weights = packed(weights, pin_memory=True)
        self._entries[adapter_id] = weights
        self._held[adapter_id] = held
        return weights

    def _victims(self, adapter_id: str, held: int, always: bool) -> list[str] | None:
        """What `put` evicts: unpinned, unqueued entries by frequency; a registration may take queued ones too."""
        need = self.nbytes + held - self.budget_bytes
        evictable = [i for i in self._entries if i not in self._pinned]
        entries = [Entry(i, self._held[i], self.sketch.estimate(i)) for i in evictable if i not in self.protected]
        victims = choose_victims(self.sketch.estimate(adapter_id), need, entries, always)
        if victims is None and always:
            entries = [Entry(i, self._held[i], self.sketch.estimate(i)) for i in evictable]
            victims = choose_victims(0, need, entries, always=True)
        return victims

    def discard(self, adapter_id: str) -> None:
        """Remove an entry that is not pinned (an unregistered adapter); nothing happens to a pinned or absent one."""
        if adapter_id in self._entries and adapter_id not in self._pinned:
            self._drop(adapter_id)

    def _drop(self, adapter_id: str) -> None:
        weights = self._entries.pop(adapter_id)
        del self._held[adapter_id]
        if self.on_evict:
            self.on_evict(adapter_id, weights)

    @property
    def pinned(self) -> frozenset[str]:
        """The adapters on the device now: never evicted while they are."""
        return frozenset(self._pinned)

    def pin(self, adapter_id: str) -> None:
        self._pinned.add(adapter_id)

    def unpin(self, adapter_id: str) -> None:
        """The adapter left the device: evictable again, and a guest is dropped."""
        self._pinned.discard(adapter_id)
        guest = self._guests.pop(adapter_id, None)
        if guest is not None and self.on_evict:
            self.on_evict(adapter_id, guest)


ALIGN = 64  # bytes: every tensor in a packed buffer starts on a cache line, so a view of any dtype is aligned


def held_bytes(weights: AdapterWeights, pinned: bool) -> int:
    """Host bytes an adapter holds: its tensors' bytes, or, page-locked, its packed buffer as CUDA's caching host
    allocator holds it: rounded up to a power of two."""
    if not pinned:
        return weights.nbytes
    size = _layout(_tensors(weights))[1]
    return 1 << (size - 1).bit_length()


def packed(weights: AdapterWeights, pin_memory: bool) -> AdapterWeights:
    """The adapter with every A and B a view of one buffer (page-locked with `pin_memory`): one host allocation."""
    tensors = _tensors(weights)
    offsets, size = _layout(tensors)
    buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)
    views = []
    for t, offset in zip(tensors, offsets, strict=True):
        views.append(buffer[offset : offset + t.nbytes].view(t.dtype).view(t.shape))
        views[-1].copy_(t)
    it = iter(views)
    return replace(weights, modules={k: replace(m, A=next(it), B=next(it)) for k, m in weights.modules.items()})


def _tensors(weights: AdapterWeights) -> list[torch.Tensor]:
    return [t for m in weights.modules.values() for t in (m.A, m.B)]


def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's byte offset in a packed buffer (on an ALIGN boundary) and the buffer's size."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(-(-end // ALIGN) * ALIGN)
        end = offsets[-1] + t.nbytes
    return offsets, max(end, 1)
