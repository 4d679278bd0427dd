"""Ray Serve's adapter-affinity routing as the pure function it is: which replicas a request for an adapter prefers,
tested without Ray (test_ray_serve.py measures it on a running deployment)."""

from __future__ import annotations

import pytest

from lora_manager.serving.routing import preference, rank_by_affinity

pytestmark = pytest.mark.unit


def test_affinity_ranks_least_busy_then_live_then_fresh_then_hash_order():
    replicas = ["r1", "r2", "r3", "r4"]
    last = {"r3": "a", "r1": "b", "r4": "a"}
    order = preference("a", replicas)
    flat = lambda ranks: [r for rank in ranks for r in rank]  # noqa: E731
    assert all(len(rank) == 1 for rank in rank_by_affinity("a", replicas, last, {}))
    idle = flat(rank_by_affinity("a", replicas, last, {}))
    assert set(idle[:2]) == {"r3", "r4"} and idle[2:] == ["r2", "r1"]
    assert idle[:2] == [r for r in order if r in ("r3", "r4")]
    busy = flat(rank_by_affinity("a", replicas, last, {"r3": 1, "r4": 2, "r2": 1}))
    assert busy == ["r1", "r3", "r2", "r4"]  # load first; then live (r3) before fresh (r2)
    assert flat(rank_by_affinity("a", replicas, {r: "x" for r in replicas}, {})) == order
    # a replica leaving moves only the adapters that preferred it: everyone else's order is unchanged
    assert preference("a", [r for r in replicas if r != order[0]]) == order[1:]
    assert preference("a", list(reversed(replicas))) == order
