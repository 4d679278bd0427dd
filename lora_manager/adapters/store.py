"""A byte-bounded LRU of adapters held in CPU memory; the live adapter is pinned and never evicted."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable

from ..errors import CacheBudgetError
from .reader import AdapterWeights


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


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
        self._entries: OrderedDict[str, AdapterWeights] = OrderedDict()
        self._pinned: set[str] = set()

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._entries

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._entries.values())

    def entries(self) -> list[str]:
        return list(self._entries)

    def get(self, adapter_id: str) -> AdapterWeights | None:
        weights = self._entries.get(adapter_id)
        if weights is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self._entries.move_to_end(adapter_id)
        return weights

    def check_fits(self, adapter_id: str, nbytes: int) -> None:
        """Raise before anything is evicted if the adapter cannot fit beside the pinned (live) ones."""
        pinned = sum(self._entries[i].nbytes for i in self._pinned if i in self._entries and i != adapter_id)
        if nbytes + pinned > self.budget_bytes:
            raise CacheBudgetError(
                f"Adapter {adapter_id!r} needs {nbytes / 2**20:.1f} MiB but the CPU cache budget is "
                f"{self.budget_bytes / 2**20:.1f} MiB ({pinned / 2**20:.1f} MiB held by the live adapter); "
                "raise cache_bytes (--cache-mb).",
                adapter_id,
            )

    def put(self, adapter_id: str, weights: AdapterWeights) -> AdapterWeights:
        """Insert (pinning host memory if asked), evicting least-recently-used unpinned entries to make room."""
        self.check_fits(adapter_id, weights.nbytes)
        if adapter_id in self._entries:
            self._drop(adapter_id)
        while self.nbytes + weights.nbytes > self.budget_bytes:
            self._drop(next(i for i in self._entries if i not in self._pinned))
            self.stats.evictions += 1
        if self.pin_memory:
            weights = _pinned_copy(weights)
        self._entries[adapter_id] = weights
        return weights

    def _drop(self, adapter_id: str) -> None:
        weights = self._entries.pop(adapter_id)
        if self.on_evict:
            self.on_evict(adapter_id, weights)

    def pin(self, adapter_id: str) -> None:
        self._pinned.add(adapter_id)

    def unpin(self, adapter_id: str) -> None:
        self._pinned.discard(adapter_id)


def _pinned_copy(weights: AdapterWeights) -> AdapterWeights:
    modules = {
        k: replace(m, A=m.A.pin_memory(), B=m.B.pin_memory()) for k, m in weights.modules.items()
    }
    return replace(weights, modules=modules)
