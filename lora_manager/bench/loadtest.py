"""Load test: K concurrent clients x M requests with adapters, strengths and seeds, against four servers.

- the engine (`LoraManager.generate`, through its scheduler, batching up to `max_batch` requests whatever their
  adapters), checked image by image against solo references, for a stream cycling over every adapter and none and
  for a stream of one adapter;
- plain diffusers serving that one adapter (`load_lora_weights`) in batches of `max_batch` prompts, one call after
  another: what batching costs without any adapter switching;
- a naive "swap on arrival" server (plain diffusers, every adapter resident, `set_adapters` when a request arrives,
  no lock): a global adapter switch, which corrupts requests already in flight;
- reload per request (`load_lora_weights` from disk, generate, `unload_lora_weights`), serialized.
Throughput of the mixed-adapter stream is compared with the single-adapter stream on the same engine and with plain
diffusers' batches.
"""

from __future__ import annotations

import copy
import json
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..adapters.sources import resolve
from ..engine import LoraManager
from ..images import levels
from ..openmp import release_idle_threads
from ..quiet import quiet_loads

PROMPTS = (
    "a red circle on a blue background",
    "a green square on a yellow background",
    "a blue diamond on a white background",
)


@dataclass(frozen=True)
class Job:
    prompt: str
    adapter: str | None
    strength: float
    seed: int


@dataclass(frozen=True)
class LoadReport:
    """One load run, in-process (`run_engine` and the plain-diffusers baselines) or over HTTP (`servebench.send`);
    the fields a kind of run cannot know are None."""

    name: str
    requests: int
    answered: int
    wall_s: float
    images_per_s: float  # answered images per second of wall time
    mismatches: int  # images more than 1 level of 255 away from their solo reference
    adapter_changes_requested: int  # consecutive requests (in submission order) whose adapters differ
    swaps: int
    wait_p50_s: float | None = None
    wait_p95_s: float | None = None
    wait_max_s: float | None = None
    batches: int | None = None  # pipeline calls the engine made for these requests
    avoidable_swaps: int | None = None  # HTTP, one client: swaps although the adapter was live on another replica
    replicas: dict[str, int] | None = None  # HTTP: answers per replica
    retried: int | None = None  # HTTP: answers that needed more than one attempt (their first replica died)
    errors: list[str] = field(default_factory=list)

    @property
    def swaps_per_request(self) -> float:
        return self.swaps / max(1, self.answered)


def report(
    name: str, jobs: list[Job], answered: list[tuple[Job, object]], wall_s: float, refs: dict, swaps: int, **extra
) -> LoadReport:
    """A LoadReport from the jobs sent and the (job, image) pairs that came back."""
    return LoadReport(
        name=name,
        requests=len(jobs),
        answered=len(answered),
        wall_s=wall_s,
        images_per_s=len(answered) / wall_s,
        mismatches=sum(levels(image, refs[job]) > 1 for job, image in answered) if refs else 0,
        adapter_changes_requested=sum(a.adapter != b.adapter for a, b in zip(jobs, jobs[1:], strict=False)),
        swaps=swaps,
        **extra,
    )


def make_jobs(adapters: list[str | None], n: int, seed: int, strengths: tuple[float, ...] = (0.6, 1.0)) -> list[Job]:
    rng = random.Random(seed)
    return [
        Job(rng.choice(PROMPTS), rng.choice(adapters), rng.choice(strengths), rng.randrange(1000)) for _ in range(n)
    ]


def cycle_jobs(adapters: list[str | None], n: int, seed: int) -> list[Job]:
    """Request i asks for adapters[i % len(adapters)]: every adapter (and none) equally often, interleaved."""
    rng = random.Random(seed)
    return [
        Job(rng.choice(PROMPTS), adapters[i % len(adapters)], rng.choice((0.6, 1.0)), rng.randrange(1000))
        for i in range(n)
    ]


def solo_references(manager: LoraManager, jobs: list[Job]) -> dict[Job, object]:
    """Each distinct job generated alone, one after another: what every concurrent result must equal."""
    return {job: manager.generate(job.prompt, job.adapter, job.strength, job.seed).image for job in dict.fromkeys(jobs)}


def run_engine(manager: LoraManager, jobs: list[Job], clients: int, refs: dict, name: str) -> LoadReport:
    """K client threads submit their share of the jobs at once; the scheduler orders and groups them. This thread ran
    the baselines: its idle OpenMP threads are freed first, as the engine frees those of threads that submit."""
    release_idle_threads()
    before = manager.stats()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        images = list(pool.map(lambda j: manager.generate(j.prompt, j.adapter, j.strength, j.seed).image, jobs))
    wall = time.perf_counter() - t0
    waits = sorted(list(manager.scheduler.stats.waits_s)[-len(jobs) :])  # this run's requests are the latest
    return report(
        name,
        jobs,
        list(zip(jobs, images, strict=True)),
        wall,
        refs,
        manager.stats()["swaps"] - before["swaps"],
        wait_p50_s=statistics.median(waits) if waits else None,
        wait_p95_s=waits[int(0.95 * (len(waits) - 1))] if waits else None,
        wait_max_s=waits[-1] if waits else None,
        batches=manager.stats()["batches"] - before["batches"],
    )


def run_naive(pipe, adapters: dict[str, Path], jobs: list[Job], clients: int, refs: dict, params: dict) -> LoadReport:
    """Every adapter resident in `pipe`; each request switches the global adapter set on arrival, with no lock."""
    import torch

    with quiet_loads():
        for name, path in adapters.items():
            pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)

    quiet = threading.Lock()  # quiet_loads changes process-wide logging state: one thread at a time

    def serve(job: Job):
        # Its own scheduler (shared modules): what is left to collide is only the global adapter switch.
        with quiet, quiet_loads():
            request_pipe = type(pipe).from_pipe(pipe, scheduler=copy.deepcopy(pipe.scheduler))
        request_pipe.set_progress_bar_config(disable=True)
        if job.adapter is None:
            pipe.disable_lora()
        else:
            pipe.enable_lora()
            pipe.set_adapters([job.adapter], [job.strength])
        gen = torch.Generator("cpu").manual_seed(job.seed)
        return request_pipe(job.prompt, generator=gen, **params).images[0]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        images = list(pool.map(serve, jobs))
    wall = time.perf_counter() - t0
    return report("naive swap-on-arrival", jobs, list(zip(jobs, images, strict=True)), wall, refs, swaps=len(jobs))


def with_lora(pipe, adapter: Path):
    """A plain diffusers pipeline with one adapter loaded normally (eval: PEFT's dropout off, as the engine's)."""
    with quiet_loads():
        pipe.load_lora_weights(str(adapter.parent), weight_name=adapter.name, adapter_name="one")
    pipe.unet.eval()
    pipe.text_encoder.eval()
    return pipe


def run_plain_batches(pipe, jobs: list[Job], batch: int, refs: dict, params: dict) -> LoadReport:
    """`pipe` (one adapter loaded, `with_lora`) serving the jobs `batch` prompts per pipeline call."""
    import torch

    t0 = time.perf_counter()
    images = []
    for i in range(0, len(jobs), batch):
        chunk = jobs[i : i + batch]
        generators = [torch.Generator("cpu").manual_seed(j.seed) for j in chunk]
        images += pipe([j.prompt for j in chunk], generator=generators, **params).images
    wall = time.perf_counter() - t0
    return report(
        f"plain diffusers, one LoRA, batches of {batch}",
        jobs,
        list(zip(jobs, images, strict=True)),
        wall,
        refs,
        swaps=0,
    )


def run_reload(pipe, adapters: dict[str, Path], jobs: list[Job], refs: dict, params: dict) -> LoadReport:
    """Reload per request: read the adapter from disk for every request, one request at a time."""
    import torch

    lock = threading.Lock()
    t0 = time.perf_counter()
    images = []
    for job in jobs:
        with lock:
            if job.adapter is not None:
                path = adapters[job.adapter]
                with quiet_loads():
                    pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name="req")
                pipe.set_adapters(["req"], [job.strength])
            gen = torch.Generator("cpu").manual_seed(job.seed)
            image = pipe(job.prompt, generator=gen, **params).images[0]
            if job.adapter is not None:
                pipe.unload_lora_weights()
        images.append(image)
    wall = time.perf_counter() - t0
    return report("reload per request", jobs, list(zip(jobs, images, strict=True)), wall, refs, swaps=len(jobs))


def main(
    clients: int = 4,
    requests: int = 8,
    seed: int = 0,
    json_out: Path | None = None,
    preset: str = "tiny",
    max_batch: int = 8,
    rounds: int = 3,
) -> dict:
    """Run all servers on the same jobs and print one JSON report. Batches fill only when at least `max_batch`
    clients send at once (`--clients 16`). The three batching servers run in turn, `rounds` times, and are compared
    on their summed times: on a shared CPU the load drifts within minutes, and this spreads it over all three."""

    manager = LoraManager.from_preset(preset, compile=False, max_batch=max_batch)
    ids = [a.id for a in manager.adapters()]
    # the files the engine read, for the plain-diffusers baselines (resolved as the engine resolves them: cached)
    paths = {
        i: resolve(s.source, s.id, s.weight_name, s.revision, True, manager.catalog_root)
        for i, s in ((i, manager.spec(i)) for i in ids)
    }
    total = clients * requests
    mixed = cycle_jobs([None, *ids], total, seed)
    single = make_jobs([ids[0]], total, seed + 1, strengths=(1.0,))  # plain diffusers serves it at strength 1
    refs = solo_references(manager, mixed + single)
    fresh = lambda: _fresh(manager.base_model, manager.dtype)  # noqa: E731
    params = manager.generation_defaults
    plain = with_lora(fresh(), paths[ids[0]])
    turns = [
        [
            run_engine(manager, single, clients, refs, "engine, one adapter"),
            run_engine(manager, mixed, clients, refs, "engine, mixed adapters"),
            run_plain_batches(plain, single, max_batch, refs, params),
        ]
        for _ in range(rounds)
    ]
    reports = [_combine(list(same)) for same in zip(*turns, strict=True)]
    reports.append(run_naive(fresh(), paths, mixed, clients, refs, params))
    reports.append(run_reload(fresh(), paths, mixed, refs, params))
    out = {
        "clients": clients,
        "requests": total,
        "max_batch": max_batch,
        "rounds": rounds,
        "device_slots": manager.stats()["device_slots"],
        "mixed_over_single_throughput": reports[1].images_per_s / reports[0].images_per_s,
        "mixed_over_plain_batches_throughput": reports[1].images_per_s / reports[2].images_per_s,
        "runs": [asdict(r) for r in reports],
    }
    text = json.dumps(out, indent=2)
    print(text)
    if json_out:
        json_out.write_text(text)
    return out


def _combine(reports: list[LoadReport]) -> LoadReport:
    """One server's rounds as one report: counts and times summed, waits the worst round's."""

    def worst(field: str) -> float | None:
        return max((getattr(r, field) for r in reports if getattr(r, field) is not None), default=None)

    total = lambda field: sum(getattr(r, field) for r in reports)  # noqa: E731
    wall = total("wall_s")
    return LoadReport(
        reports[0].name,
        total("requests"),
        total("answered"),
        wall,
        total("answered") / wall,
        total("mismatches"),
        total("adapter_changes_requested"),
        total("swaps"),
        worst("wait_p50_s"),
        worst("wait_p95_s"),
        worst("wait_max_s"),
        total("batches") if reports[0].batches is not None else None,
    )


def _fresh(base_model: str, dtype):
    """A plain diffusers pipeline of the engine's model, loaded and run without progress bars."""
    from diffusers import DiffusionPipeline

    with quiet_loads():
        pipe = DiffusionPipeline.from_pretrained(base_model, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe
