"""Skewed load test: many adapters, a CPU cache smaller than they are, and requests whose adapters follow Zipf(s).

Writes `--adapters` PEFT LoRAs of mixed ranks, target sets and alphas over the preset's own modules (into a temporary
folder, removed afterwards), registers them with one engine whose CPU cache holds `--cache-fraction` of their bytes,
then sends the same number of requests from `--clients` threads twice: all for one adapter (the most popular one),
then drawn from Zipf(`--zipf`) over all of them. Both runs use the engine's public API only (`from_preset`,
`register`, `generate`, `stats`), so they measure whatever the engine does with a miss.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..engine import LoraManager, load_pipeline
from .loadtest import PROMPTS, Job
from .lora_zoo import write_zoo
from .skewed import LoraSpec, lora_specs, percentile, zipf_trace

COUNTERS = ("cache_hits", "cache_misses", "cache_evictions", "worker_reads", "batches", "swaps", "recompiles")
SAMPLE_S = 0.05  # how often the cache's bytes and the process's resident memory are sampled during a run


@dataclass(frozen=True)
class TraceReport:
    """One run of a trace: what the clients saw, and what the engine's `stats()` counters moved by meanwhile
    (`worker_reads` is None on an engine that does not count them)."""

    name: str
    requests: int
    answered: int
    failed: int
    distinct_adapters: int
    wall_s: float
    throughput_rps: float  # answered requests per second of wall time
    latency_p50_s: float | None  # per request, from submit to result
    latency_p99_s: float | None
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    worker_reads: int | None
    batches: int
    swaps: int
    recompiles: int
    peak_cache_bytes: int
    cache_budget_bytes: int
    rss_start_bytes: int  # the process's resident memory when the run started
    rss_peak_bytes: int
    errors: list[str] = field(default_factory=list)  # distinct failure messages, the first 5


class Sampler:
    """A thread that samples the cache's bytes (`stats()`) and the process's resident memory while a run lasts."""

    def __init__(self, manager: LoraManager):
        import psutil

        self.manager, self.process, self.done = manager, psutil.Process(), threading.Event()
        self.rss_start = self.rss_peak = self.process.memory_info().rss
        self.cache_peak = manager.stats()["cache_bytes"]
        self.thread = threading.Thread(target=self._sample, name="skewtest-sampler", daemon=True)

    def _sample(self) -> None:
        while not self.done.wait(SAMPLE_S):
            self.cache_peak = max(self.cache_peak, self.manager.stats()["cache_bytes"])
            self.rss_peak = max(self.rss_peak, self.process.memory_info().rss)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def serve(manager: LoraManager, job: Job, steps: int) -> tuple[float, str | None]:
    """One request through `generate` (submit, then wait for the result): its latency and its error, if any."""
    t0 = time.perf_counter()
    try:
        manager.generate(job.prompt, job.adapter, job.strength, job.seed, steps=steps)
    except Exception as e:  # a failed request is counted and its message kept, the run goes on
        return time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    return time.perf_counter() - t0, None


def run_trace(manager: LoraManager, jobs: list[Job], clients: int, steps: int, name: str) -> TraceReport:
    """`clients` threads send the jobs, each its next one as soon as its last is answered."""
    before = manager.stats()
    with Sampler(manager) as sampler:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            outcomes = list(pool.map(lambda job: serve(manager, job, steps), jobs))
        wall = time.perf_counter() - t0
    after = manager.stats()
    moved = {k: after[k] - before[k] if k in after else None for k in COUNTERS}
    latencies = [s for s, error in outcomes if error is None]
    errors = [error for _, error in outcomes if error is not None]
    return TraceReport(
        name=name,
        requests=len(jobs),
        answered=len(latencies),
        failed=len(errors),
        distinct_adapters=len({job.adapter for job in jobs}),
        wall_s=wall,
        throughput_rps=len(latencies) / wall,
        latency_p50_s=percentile(latencies, 50) if latencies else None,
        latency_p99_s=percentile(latencies, 99) if latencies else None,
        **moved,
        peak_cache_bytes=sampler.cache_peak,
        cache_budget_bytes=after["cache_budget_bytes"],
        rss_start_bytes=sampler.rss_start,
        rss_peak_bytes=sampler.rss_peak,
        errors=list(dict.fromkeys(errors))[:5],
    )


def jobs_for(adapters: list[str], seed: int) -> list[Job]:
    """One job per entry of `adapters`, in order, with a random prompt and seed, at strength 1."""
    rng = random.Random(seed)
    return [Job(rng.choice(PROMPTS), adapter, 1.0, rng.randrange(1000)) for adapter in adapters]


def write_adapters(preset: str, specs: list[LoraSpec], folder: Path) -> dict[str, Path]:
    """The specs' files over the preset's modules (read from a CPU copy of its pipeline, dropped afterwards)."""
    pipe, _, _ = load_pipeline(preset, "cpu", "float32")
    return write_zoo(pipe, specs, folder)


def register_all(manager: LoraManager, paths: dict[str, Path]) -> dict[str, str]:
    """Register every file; the ones the engine refuses, with its message (they take no part in the runs)."""
    refused = {}
    for adapter_id, path in paths.items():
        try:
            manager.register(adapter_id, str(path))
        except Exception as e:  # a refusal is a result of the test, reported with the engine's message
            refused[adapter_id] = f"{type(e).__name__}: {e}"
    return refused


def main(
    adapters: int = 300,
    zipf: float = 1.1,
    cache_fraction: float = 0.1,
    compile: bool = False,
    max_batch: int = 4,
    clients: int = 8,
    requests: int = 240,
    steps: int = 4,
    seed: int = 0,
    json_out: Path | None = None,
    preset: str = "tiny",
) -> dict:
    """Write the adapters, start one engine, warm it up, run the one-adapter trace and then the skewed one; print a
    summary and return (and write, with `json_out`) the report."""
    settings = {k: v for k, v in locals().items() if k != "json_out"}
    t0 = time.perf_counter()
    specs = lora_specs(adapters, seed)
    with tempfile.TemporaryDirectory(prefix="lora-skewtest-") as folder:
        paths = write_adapters(preset, specs, Path(folder))
        adapter_bytes = sum(p.stat().st_size for p in paths.values())
        budget = int(adapter_bytes * cache_fraction)
        with LoraManager.from_preset(preset, compile=compile, max_batch=max_batch, cache_bytes=budget) as manager:
            refused = register_all(manager, paths)
            ids = [s.id for s in specs if s.id not in refused]
            if not ids:
                raise ValueError(f"the engine refused every adapter, e.g. {next(iter(refused.values()))}")
            one, skewed = ids[0], [ids[i] for i in zipf_trace(len(ids), requests, zipf, seed)]
            run_trace(manager, jobs_for([one] * 2 * max(clients, max_batch), seed + 2), clients, steps, "warm-up")
            runs = [
                run_trace(manager, jobs_for([one] * requests, seed + 1), clients, steps, "one adapter"),
                run_trace(manager, jobs_for(skewed, seed + 1), clients, steps, f"Zipf({zipf}) over {len(ids)}"),
            ]
            engine = {k: manager.stats()[k] for k in ("target_rank", "compile_s", "compile_source")}
    out = {
        **settings,
        "adapter_bytes": adapter_bytes,
        "cache_budget_bytes": budget,
        "adapter_ranks": [min(s.rank for s in specs), max(s.rank for s in specs)],
        "one_adapter": asdict(next(s for s in specs if s.id == one)),
        "refused": refused,
        **engine,
        **ratios(runs[0], runs[1]),
        "runs": [asdict(r) for r in runs],
        **machine(),
        "wall_s": time.perf_counter() - t0,
    }
    print(summary(out))
    if json_out:
        json_out.write_text(json.dumps(out, indent=2) + "\n")
    return out


def ratios(one: TraceReport, skewed: TraceReport) -> dict[str, float | None]:
    """The skewed run's throughput and p99 latency over the one-adapter run's (None where a run answered nothing)."""
    p99 = skewed.latency_p99_s / one.latency_p99_s if one.latency_p99_s and skewed.latency_p99_s else None
    throughput = skewed.throughput_rps / one.throughput_rps if one.throughput_rps else None
    return {"skewed_over_one_throughput": throughput, "skewed_over_one_p99": p99}


def machine() -> dict:
    """What the numbers depend on besides the code: torch, its threads, the cores."""
    import torch

    return {"torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}


def summary(out: dict) -> str:
    """The report in a few lines for people: one per run, then the ratios."""
    mode = "compiled" if out["compile"] else "eager"
    lines = [
        f"{out['preset']}, {mode}, max_batch {out['max_batch']}: {out['adapters']} adapters "
        f"({out['adapter_bytes'] / 2**20:.1f} MiB), cache budget {out['cache_budget_bytes'] / 2**20:.1f} MiB, "
        f"{out['clients']} clients, {out['steps']} steps; {len(out['refused'])} refused"
    ]
    for r in out["runs"]:
        p50, p99 = (f"{v:.2f}" if v is not None else "-" for v in (r["latency_p50_s"], r["latency_p99_s"]))
        lines.append(
            f"  {r['name']}: {r['answered']}/{r['requests']} answered, {r['failed']} failed, "
            f"{r['distinct_adapters']} distinct; {r['throughput_rps']:.2f} req/s, p50 {p50} s, p99 {p99} s; cache "
            f"{r['cache_hits']} hits / {r['cache_misses']} misses / {r['cache_evictions']} evictions, worker reads "
            f"{r['worker_reads']}, peak {r['peak_cache_bytes'] / 2**20:.1f} MiB; resident memory "
            f"+{(r['rss_peak_bytes'] - r['rss_start_bytes']) / 2**20:.0f} MiB at its peak; {r['batches']} batches, "
            f"{r['swaps']} swaps, {r['recompiles']} recompiles"
        )
    lines.append(
        f"  skewed / one adapter: throughput {out['skewed_over_one_throughput']:.2f}x, "
        f"p99 {out['skewed_over_one_p99']:.2f}x; {out['wall_s']:.0f} s in all"
    )
    return "\n".join(lines)
