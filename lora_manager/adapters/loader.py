"""Reads the adapters queued requests need on background threads while the current batch runs, so that a miss (a
Hub download, a re-read after an eviction) delays only the requests that named it, not the batches before them.

Bounded: at most `max_loads` reads at once and `max_ready` finished ones (loaded or failed) waiting to be taken;
threads start per read, so a forked child (ZeroGPU) simply starts afresh with empty state. A failed read keeps its
error until the scheduler fails the requests that named the adapter with it; the next request reads it again.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..openmp import one_thread


@dataclass
class LoaderStats:
    loads: int = 0  # reads finished in the background
    failures: int = 0  # reads that failed (their requests got the error)


@dataclass
class _State:
    """What the loads in flight write into; a forked child replaces it, so a parent's reads never land there."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    loading: set[str] = field(default_factory=set)
    done: dict[str, Any] = field(default_factory=dict)  # adapter id -> its weights, or the exception its read raised


class AdapterLoader:
    """`read(adapter_id)` reads and checks an adapter (no engine lock needed); `resident(adapter_id)` says whether
    the CPU cache already holds it. `on_done` is called (without any lock held) when a read finishes."""

    def __init__(
        self, read: Callable[[str], Any], resident: Callable[[str], bool], max_loads: int = 2, max_ready: int = 8
    ):
        self.read, self.resident = read, resident
        self.max_loads, self.max_ready = max_loads, max_ready
        self.on_done: Callable[[], None] = lambda: None
        self.stats = LoaderStats()
        self._state = _State()
        _LIVE.add(self)

    def report(self) -> dict[str, int]:
        """The loader's part of the engine's `stats()`."""
        with self._state.lock:
            loading, ready = len(self._state.loading), len(self._state.done)
        return {
            "background_loads": self.stats.loads,
            "background_load_failures": self.stats.failures,
            "loads_in_flight": loading,
            "loads_ready": ready,
        }

    def ready(self, adapter_id: str) -> bool:
        """Whether a batch can use the adapter without reading it: cached, or read and waiting to be taken."""
        state = self._state
        with state.lock:
            loaded = adapter_id in state.done and not isinstance(state.done[adapter_id], BaseException)
        return loaded or self.resident(adapter_id)

    def want(self, adapter_ids: Iterable[str]) -> None:
        """Start reading, in the order given (oldest request first), the adapters neither cached, read nor being
        read, as far as the bounds allow."""
        state = self._state
        with state.lock:
            for adapter_id in adapter_ids:
                if len(state.loading) >= self.max_loads or len(state.loading) + len(state.done) >= self.max_ready:
                    return
                if adapter_id in state.loading or adapter_id in state.done or self.resident(adapter_id):
                    continue
                state.loading.add(adapter_id)
                threading.Thread(target=self._load, args=(state, adapter_id), name="lora-loader", daemon=True).start()

    def _load(self, state: _State, adapter_id: str) -> None:
        one_thread()  # an OpenMP pool of this thread's own would slow the batch running meanwhile
        try:
            result: Any = self.read(adapter_id)
        except Exception as e:  # noqa: BLE001 - the error is the answer of the requests that named this adapter
            result = e
        with state.lock:
            state.loading.discard(adapter_id)
            state.done[adapter_id] = result
            if state is self._state:
                self.stats.loads += 1
                self.stats.failures += isinstance(result, BaseException)
        self.on_done()

    def failures(self) -> dict[str, BaseException]:
        """The failed reads' errors, each handed over once (a later request reads the adapter again)."""
        state = self._state
        with state.lock:
            failed = {a: r for a, r in state.done.items() if isinstance(r, BaseException)}
            for adapter_id in failed:
                del state.done[adapter_id]
        return failed

    def keep_only(self, adapter_ids: set[str]) -> None:
        """Drop finished reads no queued request needs any more (served otherwise, cancelled, unregistered)."""
        state = self._state
        with state.lock:
            for adapter_id in [a for a in state.done if a not in adapter_ids]:
                del state.done[adapter_id]

    def take(self, adapter_id: str) -> Any | None:
        """The adapter's finished read (None if there is none); a failed one raises its error."""
        state = self._state
        with state.lock:
            result = state.done.pop(adapter_id, None)
        if isinstance(result, BaseException):
            raise result
        return result

    def _restart_in_child(self) -> None:
        """After a fork the reads in flight belong to the parent's threads: start with nothing loading or loaded."""
        self._state = _State()


_LIVE: weakref.WeakSet[AdapterLoader] = weakref.WeakSet()  # loaders reset in a forked child
os.register_at_fork(after_in_child=lambda: [loader._restart_in_child() for loader in list(_LIVE)])
