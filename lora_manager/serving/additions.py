"""Adapters that visitors of a public Space add at run time: whose each one is, and the budget that bounds them all.

By default an addition belongs to the session that added it (Gradio's `session_hash`): only that session lists it
and may generate with it, as the multi-LoRA explorer Spaces keep a visitor's LoRAs in the visitor's own state. With
`shared=True` (a private Space) every addition is everyone's. Either way each visitor's session adds at most
`per_session`, and all additions together stay within `max_count` and `max_bytes`: room is made by dropping the least
recently used additions, those whose sessions have all closed first, so one visitor cannot lock the others out. This
object only decides; the caller registers and unregisters adapters in the engine.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ..errors import RequestError


@dataclass
class Addition:
    adapter_id: str
    nbytes: int
    owners: set[str] = field(default_factory=set)  # sessions that added it
    last_used: float = field(default_factory=time.monotonic)


class Additions:
    """Who may use each run-time addition, and which to drop when the budget is full. Thread-safe."""

    def __init__(self, per_session: int = 4, max_count: int = 16, max_bytes: int = 2 * 2**30, shared: bool = False):
        if per_session < 1 or max_count < 1 or max_bytes < 1:
            raise ValueError(f"addition limits must be at least 1, got {per_session}, {max_count}, {max_bytes}.")
        self.per_session, self.max_count, self.max_bytes, self.shared = per_session, max_count, max_bytes, shared
        self._items: dict[str, Addition] = {}
        self._closed: set[str] = set()
        self._lock = threading.Lock()

    def may_use(self, session: str | None, adapter_id: str) -> bool:
        """Whether `session` may see and use `adapter_id` (any adapter that is not an addition is public)."""
        with self._lock:
            item = self._items.get(adapter_id)
            return item is None or self.shared or session in item.owners

    def check_room(self, session: str | None) -> None:
        """Refuse, with the limit, a visitor's session that already holds `per_session` additions."""
        with self._lock:
            held = sum(1 for item in self._items.values() if session in item.owners)
        if held >= self.per_session:
            raise RequestError(
                f"You have added {held} LoRAs, the limit per visitor here is {self.per_session}; generate with those "
                "or reload the page to start a new session.",
                field="repo_id",
            )

    def add(self, session: str | None, adapter_id: str, nbytes: int) -> list[str]:
        """Record that `session` added `adapter_id` (`nbytes` in memory and on disk); returns the additions to drop
        (oldest unused first, closed sessions' before open ones') so that all of them fit the budget."""
        with self._lock:
            item = self._items.setdefault(adapter_id, Addition(adapter_id, nbytes))
            item.owners.add(session or "")
            item.last_used = time.monotonic()
            dropped = []
            for victim in sorted(self._items.values(), key=self._drop_order):
                if len(self._items) <= self.max_count and self._bytes() <= self.max_bytes:
                    break
                if victim.adapter_id != adapter_id:
                    dropped.append(victim.adapter_id)
                    del self._items[victim.adapter_id]
            return dropped

    def touch(self, adapter_ids: list[str]) -> None:
        """Mark additions as just used (the least recently used are dropped first)."""
        with self._lock:
            for adapter_id in adapter_ids:
                if adapter_id in self._items:
                    self._items[adapter_id].last_used = time.monotonic()

    def close(self, session: str | None) -> None:
        """The session ended (its tab closed): its additions are the first to go when room is needed."""
        with self._lock:
            self._closed.add(session or "")

    def _bytes(self) -> int:
        return sum(item.nbytes for item in self._items.values())

    def _drop_order(self, item: Addition) -> tuple[bool, float]:
        return (not item.owners <= self._closed, item.last_used)
