"""Adapter-grouped scheduling: one generation (or one batch) at a time, swaps kept few, waits bounded.

A request never sees another request's adapter: the worker swaps only between generations. Among queued requests it
prefers those whose adapters are live (no swap), but after `max_consecutive` such runs in a row, or once the oldest
request has waited `max_wait_s`, it serves the oldest request instead, so no adapter starves.

In a mixed layout (`Layout.mixed`) a batch mixes adapters (each row runs its own, see `hotswap/batched.py`): after the
head request it takes, in arrival order, up to `max_batch` queued requests with the same generation parameters while
the batch's adapters fit in the layout's device slots.

With `loads` (the engine's `adapters/loader.py`), only requests whose adapters are ready (cached, or read in the
background) are picked: the adapters of the others are read on background threads, oldest request first, while the
ready ones run, and a failed read fails exactly the requests that named that adapter.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import EngineClosedError, QueueFullError
from .layout import Layout
from .openmp import release_idle_threads
from .request_schema import Mix


@dataclass(frozen=True)
class Request:
    """One generation: its adapters and strengths travel with the request, never as global state."""

    prompt: str
    adapters: Mix  # (adapter id, strength) pairs; empty for the base model
    seed: int
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def adapter_ids(self) -> frozenset[str]:
        """What must be live to run this request; the order of slots does not matter."""
        return frozenset(i for i, _ in self.adapters)

    def batch_key(self) -> tuple | None:
        """Requests with equal keys (steps, size, guidance...) can share one pipeline call whatever their adapters;
        None when params hold callbacks or objects."""
        if not all(isinstance(v, (int, float, str, bool, type(None))) for v in self.params.values()):
            return None
        return tuple(sorted(self.params.items()))


@dataclass
class _Queued:
    request: Request
    future: Future
    order: int
    enqueued: float


class Loads(Protocol):
    """The background reads the scheduler steers (`adapters.loader.AdapterLoader`)."""

    def ready(self, adapter_id: str) -> bool: ...

    def want(self, adapter_ids: list[str]) -> None: ...

    def failures(self) -> dict[str, BaseException]: ...

    def keep_only(self, adapter_ids: set[str]) -> None: ...


LOAD_POLL_S = 0.5  # a worker waiting for reads looks again this often, even if no finished read woke it
WAIT_WINDOW = 1024  # queue waits kept for percentiles: a server that runs for weeks keeps the recent ones only


@dataclass
class SchedulerStats:
    completed: int = 0
    batches: int = 0
    adapter_changes: int = 0  # times the next run's adapter differed from the live one (a swap)
    max_wait_s: float = 0.0  # over the whole run
    waits_s: deque[float] = field(default_factory=lambda: deque(maxlen=WAIT_WINDOW))  # the latest, oldest first

    def wait_percentile(self, q: float) -> float | None:
        """The q-th percentile (0-100) of the latest `WAIT_WINDOW` queue waits; None before the first request."""
        waits = sorted(self.waits_s)
        return waits[round(q / 100 * (len(waits) - 1))] if waits else None


class Scheduler:
    """Owns the worker thread; `run_batch(requests)` (the engine, under its lock) does the generation and returns
    one result, or the exception that refused it, per request."""

    def __init__(
        self,
        run_batch: Callable[[list[Request]], list[Any]],
        live_adapters: Callable[[], frozenset[str]],
        layout: Layout | None = None,
        max_queue: int = 64,
        max_consecutive: int = 4,
        max_wait_s: float = 30.0,
        batch_window_s: float = 0.01,
        loads: Loads | None = None,
    ):
        self.run_batch = run_batch
        self.live_adapters = live_adapters
        self.max_queue = max_queue
        self.max_consecutive = max_consecutive
        self.max_wait_s = max_wait_s
        self.layout = layout or Layout()  # a batch holds at most max_batch requests and device_slots adapters
        # in mixed batches, how long an idle worker waits for a batch to fill once a first request arrives:
        # clients that send at nearly the same time then share one call instead of a lone first request taking one
        self.batch_window_s = batch_window_s
        self.loads = loads
        self.stats = SchedulerStats()
        self._order = itertools.count()
        self._streak = 0
        self._closed = False
        self._start()
        _LIVE.add(self)

    def _start(self) -> None:
        self._queue: list[_Queued] = []
        self._cond = threading.Condition()
        self._worker = threading.Thread(target=self._loop, name="lora-scheduler", daemon=True)
        self._worker.start()

    def submit(self, request: Request) -> Future:
        """Queue a request; a full queue answers at once with QueueFullError rather than waiting without bound."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise EngineClosedError("The engine is closed; create a new one to serve requests.")
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(f"Busy: {len(self._queue)} requests are queued (limit {self.max_queue}); retry.")
            self._queue.append(_Queued(request, future, next(self._order), time.monotonic()))
            if self.loads is not None:  # start its reads now, while the worker may be running a batch
                self.loads.want(self._needs())
            self._cond.notify()
        return future

    def wake(self) -> None:
        """A background read finished: start the next ones and let the worker look at the queue again."""
        with self._cond:
            if self.loads is not None:
                self.loads.want(self._needs())
            self._cond.notify_all()

    def _needs(self) -> list[str]:
        """Adapters of queued requests, oldest request first (caller holds the condition)."""
        queue = sorted(self._queue, key=lambda q: q.order)
        return list(dict.fromkeys(i for q in queue for i, _ in q.request.adapters))

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def report(self) -> dict[str, Any]:
        """The scheduler's part of the engine's `stats()`."""
        return {
            "batches": self.stats.batches,
            "queued": self.pending(),
            "adapter_changes": self.stats.adapter_changes,
            "max_wait_s": self.stats.max_wait_s,
            "wait_p50_s": self.stats.wait_percentile(50),
            "wait_p95_s": self.stats.wait_percentile(95),
        }

    def upcoming(self) -> list[str]:
        """Adapters of queued requests, oldest request first (what the next batches will likely need)."""
        with self._cond:
            return self._needs()

    def close(self) -> None:
        """Stop the worker after the batch it is running; queued requests fail with EngineClosedError."""
        with self._cond:
            self._closed = True
            dropped, self._queue = self._queue, []
            self._cond.notify_all()
        for q in dropped:
            q.future.set_exception(EngineClosedError("The engine was closed before this request ran."))
        if self._worker is not threading.current_thread():
            self._worker.join()
        _LIVE.discard(self)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    release_idle_threads()  # idle: its OpenMP threads would slow torch work on other threads
                    self._cond.wait()
                    if self.layout.mixed:
                        self._fill(time.monotonic() + self.batch_window_s)
                if self._closed:
                    return
                failed = self._take_failed()
                batch = self._pick() if self._queue else []
                if not batch and not failed:  # every queued request waits for a read: until one finishes
                    self._cond.wait(LOAD_POLL_S)
            for q, error in failed:
                if q.future.set_running_or_notify_cancel():
                    q.future.set_exception(error)
            if batch:
                self._run(batch)

    def _take_failed(self) -> list[tuple[_Queued, BaseException]]:
        """Remove the queued requests naming an adapter whose background read failed, each with that error."""
        errors = self.loads.failures() if self.loads is not None else {}
        failed = [
            (q, errors[min(errors.keys() & q.request.adapter_ids)])
            for q in self._queue
            if errors.keys() & q.request.adapter_ids
        ]
        for q, _ in failed:
            self._queue.remove(q)
        return failed

    def _fill(self, deadline: float) -> None:
        """Wait (holding the condition, released while waiting) until the queue holds max_batch requests, the
        deadline passes, or the scheduler closes."""
        while (
            len(self._queue) < self.layout.max_batch and not self._closed and (left := deadline - time.monotonic()) > 0
        ):
            self._cond.wait(left)

    def _restart_in_child(self) -> None:
        """After a fork (ZeroGPU runs each GPU call in a process forked from the app) the worker thread does not exist
        in the child, and the parent's queued requests belong to callers that live in the parent: start afresh."""
        if not self._closed:
            self._start()

    def _pick(self) -> list[_Queued]:
        """Choose the next group (caller holds the condition) among the requests whose adapters need no read (none:
        an empty group): live adapters first, within the fairness bounds. One request per call (not mixed) is
        ready when it needs exactly the live adapters; in mixed batches, when all its adapters are live."""
        now = time.monotonic()
        queue = sorted(self._queue, key=lambda q: q.order)
        if self.loads is not None:  # only requests whose adapters need no read; the others' reads start
            needs = self._needs()
            self.loads.keep_only(set(needs))
            self.loads.want(needs)
            queue = [q for q in queue if all(self.loads.ready(a) for a in q.request.adapter_ids)]
            if not queue:
                return []
        oldest = queue[0]
        live = self.live_adapters()
        ready = (lambda ids: ids <= live) if self.layout.mixed else (lambda ids: ids == live)
        same = [q for q in queue if ready(q.request.adapter_ids)]
        fair = self._streak < self.max_consecutive and now - oldest.enqueued < self.max_wait_s
        head = same[0] if same and fair else oldest
        key = head.request.batch_key()
        group, adapters = [head], set(head.request.adapter_ids)
        for q in queue if key is not None else ():
            if len(group) == self.layout.max_batch:
                break
            fits = len(adapters | q.request.adapter_ids) <= self.layout.device_slots
            if q is not head and q.request.batch_key() == key and fits:
                group.append(q)
                adapters |= q.request.adapter_ids
        for q in group:
            self._queue.remove(q)
        self._streak = self._streak + 1 if ready(head.request.adapter_ids) else 1
        swaps = not adapters <= live if self.layout.mixed else head.request.adapter_ids != live
        self.stats.adapter_changes += swaps
        return group

    def _run(self, group: list[_Queued]) -> None:
        start = time.monotonic()
        for q in group:
            if not q.future.set_running_or_notify_cancel():
                group = [g for g in group if g is not q]
        if not group:
            return
        try:
            results = self.run_batch([q.request for q in group])
        except BaseException as e:  # the error belongs to these requests; the worker serves the next ones
            for q in group:
                q.future.set_exception(e)
            return
        finally:
            waits = [start - q.enqueued for q in group]
            self.stats.waits_s.extend(waits)
            self.stats.max_wait_s = max([self.stats.max_wait_s, *waits])
            self.stats.batches += 1
        for q, result in zip(group, results, strict=True):  # an exception fails only the requests it belongs to
            self.stats.completed += 1
            if isinstance(result, BaseException):
                q.future.set_exception(result)
            else:
                q.future.set_result(result)


_LIVE: weakref.WeakSet[Scheduler] = weakref.WeakSet()  # open schedulers, restarted in a forked child
os.register_at_fork(after_in_child=lambda: [s._restart_in_child() for s in list(_LIVE)])
