"""Which adapters the CPU cache keeps when traffic is skewed: a TinyLFU frequency sketch of recent requests, and the
choice of victims that lets a newcomer in only when every adapter it would evict is requested less often than it.

Plain LRU lets a burst of rarely used adapters push the popular ones out (each costs a re-read a moment later);
comparing recent request counts keeps the hot set and leaves the one-off adapters out instead. Nothing here imports
torch: the policy is plain bookkeeping over ids, sizes and counts.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass

DEPTH = 4  # rows of the count-min sketch: an id's estimate is its smallest counter, so collisions rarely inflate it
CELL_BITS = 16  # each row's cell comes from its own 16 bits of one 64-bit digest: widths up to 2**16
MAX_COUNT = 15  # counters saturate here (TinyLFU's 4 bits): a hot adapter needs no higher count to win


class FrequencySketch:
    """Approximate recent request counts per adapter id in fixed memory (a count-min sketch). After `sample`
    recorded requests every counter halves, so the counts follow what is popular now rather than since start-up."""

    def __init__(self, width: int = 1024, sample: int | None = None):
        self.width = min(1 << max(0, width - 1).bit_length(), 1 << CELL_BITS)
        self.sample = sample or 10 * self.width
        self._rows = [[0] * self.width for _ in range(DEPTH)]
        self._recorded = 0
        self._lock = threading.Lock()  # requests are recorded from the callers' threads

    def _cells(self, key: str) -> list[int]:
        """The key's counter in each row (a digest, not `hash`: the same cells in every process, for every run)."""
        digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        return [(digest >> (CELL_BITS * row)) & (self.width - 1) for row in range(DEPTH)]

    def record(self, key: str) -> None:
        """Count one request for `key` (conservative update: only its smallest counters grow)."""
        with self._lock:
            cells = self._cells(key)
            low = min(row[c] for row, c in zip(self._rows, cells, strict=True))
            if low < MAX_COUNT:
                for row, c in zip(self._rows, cells, strict=True):
                    if row[c] == low:
                        row[c] += 1
            self._recorded += 1
            if self._recorded >= self.sample:
                self._age()

    def _age(self) -> None:
        for row in self._rows:
            row[:] = [c >> 1 for c in row]
        self._recorded //= 2

    def estimate(self, key: str) -> int:
        """Recent requests for `key` (never fewer than were recorded since the last halving, rarely more)."""
        with self._lock:
            return min(row[c] for row, c in zip(self._rows, self._cells(key), strict=True))


@dataclass(frozen=True)
class Entry:
    """One cached adapter as the policy sees it."""

    id: str
    nbytes: int
    frequency: int


def choose_victims(frequency: int, need_bytes: int, entries: Iterable[Entry], always: bool = False) -> list[str] | None:
    """The entries to evict so that `need_bytes` more fit, coldest first (ties: least recently used first); None
    when the newcomer (`frequency` recent requests) is not admitted: some victim is requested at least as often, or
    evicting them all would not make room. `entries` are the evictable ones, least recently used first; `always`
    (an adapter being registered) admits whatever the victims' counts."""
    if need_bytes <= 0:
        return []
    victims, freed = [], 0
    ranked = sorted(enumerate(entries), key=lambda e: (e[1].frequency, e[0]))
    for _, entry in ranked:
        if freed >= need_bytes:
            break
        if entry.frequency >= frequency and not always:
            return None
        victims.append(entry.id)
        freed += entry.nbytes
    return victims if freed >= need_bytes else None
