"""Ray Serve scale-out: a local Ray instance, 2 CPU replicas of the tiny preset per app, a mixed load over HTTP.

One run (`bench.servebench.run`, also `python -m lora_manager servebench`) serves the same jobs with Ray Serve's default
multiplexed routing and with `AdapterAffinityRouter`, then kills a replica under a concurrent load.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="tests/requirements.txt installs ray[serve]")


@pytest.fixture(scope="module")
def deployment():
    from lora_manager.bench import servebench as serve_bench

    with serve_bench.running("tiny", replicas=2) as (base, ready_s):
        print(f"Ray Serve apps ready in {ready_s:.1f} s")
        yield base


@pytest.fixture(scope="module")
def report(deployment):
    from lora_manager.bench import servebench as serve_bench

    # the kill load at 16 requests, not servebench's 32: each needs a solo reference (about 1.8 s apiece on 2 cores)
    out = serve_bench.measure(deployment, "tiny", requests=16, clients=2, kill_requests=16)
    print(json.dumps(out, indent=2))
    return {load["name"]: load for load in out["loads"]} | {"killed": out["killed"]}


LOADS = [f"{r} routing, {n}" for n in ("1 client", "2 clients") for r in ("default", "affinity")]


@pytest.mark.ray
def test_every_answer_equals_its_solo_reference(report):
    for name in LOADS:
        load = report[name]
        assert load["errors"] == [] and load["answered"] == load["requests"] == 16, load
        assert load["mismatches"] == 0, load


@pytest.mark.ray
def test_affinity_routing_never_swaps_when_the_adapter_is_live_somewhere(report):
    """One request at a time: both replicas are free, so the router alone decides; it must pick the replica that
    holds the request's adapter whenever one does. Under load it spreads requests over both replicas."""
    default, affinity = report["default routing, 1 client"], report["affinity routing, 1 client"]
    print(
        f"swaps per request, 1 client: default {default['swaps_per_request']:.2f} "
        f"({default['avoidable_swaps']} avoidable), affinity {affinity['swaps_per_request']:.2f}"
    )
    assert affinity["avoidable_swaps"] == 0 and affinity["swaps"] <= affinity["adapter_changes_requested"]
    assert len(report["affinity routing, 2 clients"]["replicas"]) == 2


@pytest.mark.ray
def test_a_killed_replica_loses_no_request(report):
    load = report["affinity, one replica killed"]
    assert len(report["killed"]) == 1
    assert load["errors"] == [] and load["answered"] == load["requests"] == 16, load
    assert load["mismatches"] == 0


@pytest.mark.ray
def test_a_killed_replica_leaves_the_metrics(deployment, report):
    """A scrape after the kill lists the live replicas only: the killed replica, which answered before it died, is gone
    from every per-replica family."""
    killed = report["killed"][0].rsplit("#", 1)[-1]
    answered = {r for name, load in report.items() if name.startswith("affinity routing") for r in load["replicas"]}
    assert killed in answered, (killed, answered)  # its state reached the ingress with its answers
    replicas = {s.labels["replica"] for s in scrape(f"{deployment}/affinity")["lora_queue_depth"].samples}
    assert replicas and killed not in replicas, (killed, replicas)


@pytest.mark.ray
def test_the_app_runs_on_the_ray_backend(deployment, report):
    """`python app.py --backend ray`: the same UI and API, generation on the replicas (after the kill test: a
    replacement replica is serving by now)."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError
    from PIL import Image

    from lora_manager import LoraManager

    from helpers import PROMPT, adapter_ids, running_app

    a, b = adapter_ids()[:2]
    with running_app("--backend", "ray", "--ray-url", f"{deployment}/affinity") as url:
        client = Client(url, verbose=False)
        path, info = client.predict(PROMPT, a, 0.8, 3, 4, api_name="/generate")
        assert info["adapter"] == a and info["replica"] and info["attempts"] == 1
        solo = LoraManager.from_preset("tiny").generate(PROMPT, a, 0.8, 3, 4).image
        diff = np.abs(np.asarray(Image.open(path).convert("RGB"), dtype=int) - np.asarray(solo, dtype=int))
        assert diff.max() <= 1
        with pytest.raises(AppError, match="2 adapters requested but this engine has 1 hotswap slot"):
            client.predict(PROMPT, [a, b], 1.0, 0, 2, api_name="/generate")
        status = client.predict("tester/copy", "", api_name="/add_adapter")
        assert "needs the in-process engine" in status


@pytest.fixture(scope="module")
def openai_client(deployment):
    """The OpenAI Python client on the affinity app (no retries: a refusal must surface as its typed error)."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{deployment}/affinity/v1", api_key="x", max_retries=0)


@pytest.mark.ray
def test_openai_client_lists_adapters_and_generates_the_engines_images(openai_client):
    import base64
    import io

    import openai
    from PIL import Image

    from lora_manager import LoraManager

    from helpers import PROMPT

    engine = LoraManager.from_preset("tiny")
    models = {m.id: m for m in openai_client.models.list()}
    base = engine.model_name
    assert set(models) == {base, *(a.id for a in engine.adapters())}
    assert models[base].parent is None and models[base].root == base
    assert all(m.parent == base and m.root == base for i, m in models.items() if i != base)
    adapter = engine.adapters()[0].id
    extra = {"seed": 3, "steps": 2, "strength": 0.8, "guidance_scale": 5.0}
    answer = openai_client.images.generate(model=adapter, prompt=PROMPT, n=2, size="64x64", extra_body=extra)
    assert answer.size == "64x64" and len(answer.data) == 2
    for i, image in enumerate(answer.data):
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(image.b64_json))).convert("RGB"), dtype=int)
        solo = engine.generate(PROMPT, adapter, 0.8, 3 + i, 2, guidance_scale=5.0).image
        assert np.abs(got - np.asarray(solo, dtype=int)).max() <= 1, f"image {i} (seed {3 + i})"
    refusals = [
        (openai.NotFoundError, "model", {"model": "no-such-adapter"}),
        (openai.UnprocessableEntityError, "size", {"model": adapter, "size": "63x64"}),
        (openai.UnprocessableEntityError, "response_format", {"model": adapter, "response_format": "url"}),
        (openai.UnprocessableEntityError, "steps", {"model": adapter, "extra_body": {"steps": 0}}),
    ]
    for kind, param, kwargs in refusals:
        with pytest.raises(kind) as refused:
            openai_client.images.generate(prompt=PROMPT, **kwargs)
        assert refused.value.body["param"] == param, refused.value.body


METRIC_FAMILIES = {
    "lora_requests": "counter",
    "lora_request_latency_seconds": "histogram",
    "lora_batch_size": "histogram",
    "lora_swap_seconds": "histogram",
    "lora_ingress_in_flight": "gauge",
    "lora_queue_depth": "gauge",
    "lora_recompiles": "counter",
    "lora_swaps": "counter",
    "lora_adapter_cache_bytes": "gauge",
    "lora_adapter_cache_hits": "counter",
    "lora_adapter_cache_misses": "counter",
    "lora_adapter_cache_evictions": "counter",
    "lora_adapter_background_reads": "counter",
    "lora_adapter_worker_reads": "counter",
    "lora_requests_info": "gauge",
}


def scrape(url: str) -> dict:
    """`GET /metrics` read by prometheus_client's own parser: {family name: family}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:300]
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def sample(families: dict, name: str, **labels) -> float:
    """The sum of the samples called `name` (`_total`, `_count`... included) whose labels hold `labels`."""
    found = [
        s.value for f in families.values() for s in f.samples if s.name == name and labels.items() <= s.labels.items()
    ]
    return sum(found)


@pytest.mark.ray
def test_metrics_hold_every_family_and_count_requests(deployment, openai_client):
    import openai

    from helpers import PROMPT

    url = f"{deployment}/affinity"
    before = scrape(url)
    assert {n: before[n].type for n in METRIC_FAMILIES if n in before} == METRIC_FAMILIES
    adapter = next(m.id for m in openai_client.models.list() if m.parent)
    openai_client.images.generate(model=adapter, prompt=PROMPT, n=2, extra_body={"steps": 2})
    with pytest.raises(openai.NotFoundError):
        openai_client.images.generate(model="no-such-adapter", prompt=PROMPT)
    after = scrape(url)
    route = "/v1/images/generations"
    moved = lambda name, **labels: sample(after, name, **labels) - sample(before, name, **labels)  # noqa: E731
    assert moved("lora_requests_total", route=route, adapter=adapter, outcome="success") == 1
    assert moved("lora_requests_total", route=route, outcome="not_found") == 1
    assert moved("lora_request_latency_seconds_count", route=route) == 2
    assert moved("lora_batch_size_count") == 2 and moved("lora_swap_seconds_count") == 2
    info = [s for s in after["lora_requests_info"].samples if s.name == "lora_requests_info"]
    assert info and all({"running_lora_adapters", "waiting_lora_adapters", "max_lora"} <= set(s.labels) for s in info)
    assert any(adapter in s.labels["running_lora_adapters"].split(",") for s in info)
    assert sample(after, "lora_adapter_cache_bytes") > 0
