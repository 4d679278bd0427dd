"""One seed with many adapters, run as one mixed batch and again one by one, over the `Engine` protocol.

The batch is every request sent at once, one thread each, as concurrent visitors send them: the engine's scheduler
runs those with equal settings together, up to its `max_batch` a pipeline call, each row with its own adapter. One by
one is the same requests, each sent when the one before has its image. The batch runs first, so adapters still to be
read from disk are read in its time: the speed-up it shows is not flattered by a warm cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from ..images import levels
from ..request_schema import check_request
from ..specs import Result
from .protocol import Engine


@dataclass(frozen=True)
class Row:
    """One image of a comparison: its adapter, the strength it applies at and the prompt (its trigger added)."""

    adapter_id: str
    prompt: str
    strength: float = 1.0


@dataclass(frozen=True)
class Comparison:
    """The batch's results in the rows' order, its time and pipeline calls, and the one-by-one run beside it (None
    where the engine runs one request per call: one by one would time the same calls again)."""

    results: list[Result]
    batch_s: float
    batch_calls: int
    solo_s: float | None
    max_levels: int | None  # the largest difference of a batch image from its one-by-one image, in levels of 255

    @property
    def speedup(self) -> float | None:
        return self.solo_s / self.batch_s if self.solo_s is not None and self.batch_s > 0 else None


def compare(
    engine: Engine, rows: list[Row], seed: int, steps: int | None, progress: Callable[[int, int], None] | None = None
) -> Comparison:
    """Run `rows` with `seed` and `steps` as one mixed batch, then one by one unless the engine's `max_batch` is 1.
    Every request is checked before any runs (a refusal raises `RequestError`); `progress(done, total)` is called
    from this thread as images arrive."""
    for row in rows:
        check_request(row.prompt, row.adapter_id, row.strength, seed, steps, engine.max_adapters)
    one_per_call = engine.stats().get("max_batch", 1) == 1
    total = len(rows) * (1 if one_per_call else 2)
    report = progress or (lambda done, total: None)
    report(0, total)
    t0 = time.perf_counter()
    batch = _all_at_once(engine, rows, seed, steps, lambda done: report(done, total))
    batch_s = time.perf_counter() - t0
    if one_per_call:
        return Comparison(batch, batch_s, pipeline_calls(batch), None, None)
    t0, solo = time.perf_counter(), []
    for row in rows:
        solo.append(engine.generate(row.prompt, adapter=row.adapter_id, strength=row.strength, seed=seed, steps=steps))
        report(len(rows) + len(solo), total)
    solo_s = time.perf_counter() - t0
    diff = max(levels(b.image, s.image) for b, s in zip(batch, solo, strict=True))
    return Comparison(batch, batch_s, pipeline_calls(batch), solo_s, diff)


def _all_at_once(
    engine: Engine, rows: list[Row], seed: int, steps: int | None, done: Callable[[int], None]
) -> list[Result]:
    """Every row's request sent at once, one thread each; the results in the rows' order (the first error raised)."""
    with ThreadPoolExecutor(len(rows), thread_name_prefix="compare") as pool:
        futures = [
            pool.submit(engine.generate, r.prompt, adapter=r.adapter_id, strength=r.strength, seed=seed, steps=steps)
            for r in rows
        ]
        for n, _ in enumerate(as_completed(futures), 1):
            done(n)
        return [f.result() for f in futures]


def pipeline_calls(results: list[Result]) -> int:
    """How many pipeline calls ran `results`: the rows of one call share its timings."""
    return len({(r.info["swap_ms"], r.info["generate_ms"]) for r in results})
