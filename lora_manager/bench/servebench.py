"""`python -m lora_manager servebench`: the Ray Serve app on a local Ray instance, measured over HTTP.

Two applications run side by side on the same replicas' settings, one with Ray Serve's default multiplexed routing
and one with `AdapterAffinityRouter`, and get the same mixed-adapter jobs (half for one LoRA, a quarter for a second,
the rest for a third or none), sent one at a time (a replica is always
free: routing alone decides where a request lands) and from `clients` threads. Every image is compared with its solo
reference from `LoraManager.generate`; swaps are counted from each answer's `swap_ms`. Then one replica of the
affinity app is killed while a concurrent load runs: every request must still get exactly one correct answer.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import httpx

from ..engine import LoraManager
from ..serving.protocol import answer_image, request_body
from ..testing import free_port
from .loadtest import Job, LoadReport, make_jobs, report, solo_references

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def send(url: str, jobs: list[Job], clients: int, refs: dict, name: str, after_first=None) -> LoadReport:
    """POST every job from `clients` threads; `after_first(n)` runs once, when n answers have arrived."""
    answers: list[dict | None] = [None] * len(jobs)
    errors: list[str] = []
    done, lock = [0], threading.Lock()

    def post(i: int) -> None:
        job = jobs[i]
        body = request_body(job.prompt, job.adapter, job.strength, job.seed)
        try:
            r = httpx.post(f"{url}/generate", json=body, timeout=TIMEOUT_S)
            r.raise_for_status()
            answers[i] = r.json()
        except httpx.HTTPError as e:
            errors.append(f"job {i}: {e}")
        with lock:
            done[0] += 1
            now = done[0]
        if after_first is not None and now == after_first[0]:
            after_first[1]()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(post, range(len(jobs))))
    wall = time.perf_counter() - t0
    ok = [(job, a) for job, a in zip(jobs, answers, strict=True) if a is not None]
    images = [answer_image(a) for _, a in ok]
    swaps = sum(a["info"]["swap_ms"] > 0 for _, a in ok)
    avoidable = None
    if clients == 1:  # answers arrive in job order: replay which adapter each replica held
        live: dict[str, str | None] = {}
        avoidable = 0
        for job, a in ok:
            avoidable += a["info"]["swap_ms"] > 0 and job.adapter in live.values()
            live[a["info"]["replica"]] = job.adapter
    return report(
        name,
        jobs,
        [(job, img) for (job, _), img in zip(ok, images, strict=True)],
        wall,
        refs,
        swaps,
        avoidable_swaps=avoidable,
        replicas=dict(Counter(a["info"]["replica"] for _, a in ok)),
        retried=sum(a["info"]["attempts"] > 1 for _, a in ok),
        errors=errors,
    )


def kill_one_replica(app: str) -> str:
    """Kill one replica actor of `app` (Serve starts a new one); returns its actor name."""
    import ray

    from ..serving.ray_app import replica_actors

    name = min(replica_actors(app).values())
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return name


@contextmanager
def running(preset: str = "tiny", replicas: int = 2) -> Iterator[tuple[str, float]]:
    """A local Ray with both apps (`/default`, `/affinity`) on a free port; yields (base URL, seconds to ready)."""
    import ray
    from ray import serve

    from ..serving.ray_app import ROUTINGS, build_app

    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    # Logical CPUs: Ray schedules by them; the real cores are shared (each replica runs one torch thread).
    ray.init(num_cpus=2 * replicas + 2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.perf_counter()
        for routing in ROUTINGS:
            serve.run(
                build_app(preset, replicas, routing, compile=False, threads=1), name=routing, route_prefix=f"/{routing}"
            )
        yield f"http://127.0.0.1:{port}", time.perf_counter() - t0
    finally:
        serve.shutdown()
        ray.shutdown()


def measure(
    base: str,
    preset: str = "tiny",
    requests: int = 16,
    clients: int = 2,
    seed: int = 0,
    kill_requests: int | None = None,
) -> dict:
    """The loads against running apps: each routing with one client and with `clients`, then the replica kill under
    `kill_requests` jobs (default: twice `requests`) from twice the clients."""
    manager = LoraManager.from_preset(preset, compile=False)
    a, b, c = [x.id for x in manager.adapters()][:3]
    popular = [a, a, a, a, b, b, c, None]  # a few LoRAs get most requests, as on any Space
    jobs = make_jobs(popular, requests, seed)
    kill_jobs = make_jobs(popular, kill_requests or 2 * requests, seed + 1)
    refs = solo_references(manager, jobs + kill_jobs)
    loads = [
        send(f"{base}/{r}", jobs, n, refs, f"{r} routing, {n} client{'s' * (n > 1)}")
        for n in sorted({1, clients})
        for r in ("default", "affinity")
    ]
    killed: list[str] = []
    loads.append(
        send(
            f"{base}/affinity",
            kill_jobs,
            2 * clients,
            refs,
            "affinity, one replica killed",
            after_first=(len(kill_jobs) // 4, lambda: killed.append(kill_one_replica("affinity"))),
        )
    )
    return {
        "preset": preset,
        "clients": clients,
        "killed": killed,
        "loads": [asdict(r) | {"swaps_per_request": r.swaps_per_request} for r in loads],
    }


def run(preset: str = "tiny", replicas: int = 2, requests: int = 16, clients: int = 2, seed: int = 0) -> dict:
    """Start Ray and both apps, run the loads, shut everything down; returns the report."""
    with running(preset, replicas) as (base, ready_s):
        return {"replicas_per_app": replicas, "apps_ready_s": ready_s, **measure(base, preset, requests, clients, seed)}


def main(args) -> None:
    report = run(args.preset, args.replicas, args.requests, args.clients, args.seed)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
