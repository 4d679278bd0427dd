"""Ray Serve scale-out: a local Ray instance, 2 CPU replicas of the tiny preset per app, a mixed load over HTTP.

One run (`bench.serve_load.run`, also `python -m lora_manager servebench`) serves the same jobs with Ray Serve's default
multiplexed routing and with `AdapterAffinityRouter`, then kills a replica under a concurrent load.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="tests/requirements.txt installs ray[serve]")


@pytest.fixture(scope="module")
def deployment():
    from lora_manager.bench import serve_load as serve_bench

    with serve_bench.running("tiny", replicas=2) as (base, ready_s):
        print(f"Ray Serve apps ready in {ready_s:.1f} s")
        yield base


@pytest.fixture(scope="module")
def report(deployment):
    from lora_manager.bench import serve_load as serve_bench

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
