"""Ray Serve scale-out: a local Ray instance, 2 CPU replicas of the tiny preset per app, a mixed load over HTTP.

One run (`serve_bench.run`, also `python -m lora_manager servebench`) serves the same jobs with Ray Serve's default
multiplexed routing and with `AdapterAffinityRouter`, then kills a replica under a concurrent load.
"""

from __future__ import annotations

import json

import pytest

from lora_manager.routing import preference, rank_by_affinity

ray = pytest.importorskip("ray", reason="tests/requirements.txt installs ray[serve]")


def test_affinity_ranks_live_then_fresh_then_hash_order():
    replicas = ["r1", "r2", "r3", "r4"]
    ranks = rank_by_affinity("a", replicas, {"r3": "a", "r1": "b", "r4": "a"})
    assert sorted(ranks[0]) == ["r3", "r4"] and ranks[1] == ["r2"] and ranks[2:] == [["r1"]]
    order = preference("a", replicas)
    assert rank_by_affinity("a", replicas, {r: "x" for r in replicas}) == [[r] for r in order]
    # a replica leaving moves only its own adapters: everyone else's order is unchanged
    assert preference("a", [r for r in replicas if r != order[0]]) == order[1:]
    assert preference("a", list(reversed(replicas))) == order


@pytest.fixture(scope="module")
def report():
    from lora_manager import serve_bench

    out = serve_bench.run("tiny", replicas=2, requests=16, clients=2)
    print(json.dumps(out, indent=2))
    return {load["name"]: load for load in out["loads"]} | {"killed": out["killed"]}


def test_every_answer_equals_its_solo_reference(report):
    for name in ("default routing", "affinity routing"):
        load = report[name]
        assert load["errors"] == [] and load["answered"] == load["requests"] == 16, load
        assert load["mismatches"] == 0, load


def test_affinity_routing_swaps_less_than_default(report):
    default, affinity = report["default routing"], report["affinity routing"]
    print(f"swaps per request: default {default['swaps_per_request']:.2f}, affinity {affinity['swaps_per_request']:.2f}")
    assert affinity["swaps"] <= default["swaps"]
    assert len(default["replicas"]) == 2  # both replicas served: the comparison is not one idle replica


def test_a_killed_replica_loses_no_request(report):
    load = report["affinity, one replica killed"]
    assert len(report["killed"]) == 1
    assert load["errors"] == [] and load["answered"] == load["requests"] == 32, load
    assert load["mismatches"] == 0
