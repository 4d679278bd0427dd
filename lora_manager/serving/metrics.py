"""Prometheus metrics of the HTTP server (`GET /metrics`), in one `CollectorRegistry` per ingress (not the global one,
which Ray's own metrics use).

The ingress counts what it sees (requests by route, adapter and outcome; latency; requests in flight) and every
answer from a replica carries that replica's state (`replica_state`), so per-replica values (queue depth, recompiles,
adapter cache, running and waiting adapters) are as of that replica's latest answer; a scrape drops replicas that are
no longer alive. The running/waiting family
follows vLLM's `vllm:lora_requests_info`: one sample per replica whose labels list the adapters, valued at the time
of the state.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
SWAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)


# the engine's counters and cache bytes a replica reports as they are
COUNTED = (
    "recompiles",
    "swaps",
    "cache_bytes",
    "cache_hits",
    "cache_misses",
    "cache_evictions",
    "background_loads",
    "worker_reads",
)


def replica_state(manager, replica: str) -> dict[str, Any]:
    """A replica's engine state as plain data, sent with each answer (it crosses Ray)."""
    stats = manager.stats()
    return {
        "replica": replica,
        "time": time.time(),
        "queued": stats["queued"],
        "running": [a for a in stats["live"] if a],
        "waiting": manager.scheduler.upcoming(),
        "max_lora": stats["slots"],
        **{k: stats[k] for k in COUNTED},
    }


class ReplicaCollector(Collector):
    """Per-replica families from the latest state each replica sent."""

    def __init__(self) -> None:
        self.states: dict[str, dict[str, Any]] = {}

    def keep(self, live: set[str]) -> None:
        """Forget the replicas not in `live` (dead ones: Serve replaces a dead replica with a new id)."""
        if live:  # an empty listing says nothing about who is alive
            self.states = {replica: state for replica, state in self.states.items() if replica in live}

    def collect(self) -> Iterator[Metric]:
        labels = ["replica"]
        families = {
            "queued": GaugeMetricFamily("lora_queue_depth", "Requests queued in the replica's engine.", labels=labels),
            "recompiles": CounterMetricFamily("lora_recompiles", "Graphs compiled after warm-up.", labels=labels),
            "swaps": CounterMetricFamily("lora_swaps", "Adapter swaps into the hotswap slots.", labels=labels),
            "cache_bytes": GaugeMetricFamily(
                "lora_adapter_cache_bytes", "Bytes of adapter weights held in the CPU cache.", labels=labels
            ),
            "cache_hits": CounterMetricFamily("lora_adapter_cache_hits", "CPU cache hits.", labels=labels),
            "cache_misses": CounterMetricFamily("lora_adapter_cache_misses", "CPU cache misses.", labels=labels),
            "cache_evictions": CounterMetricFamily(
                "lora_adapter_cache_evictions", "Adapters evicted from the CPU cache.", labels=labels
            ),
            "background_loads": CounterMetricFamily(
                "lora_adapter_background_reads", "Cache misses read off the worker while batches ran.", labels=labels
            ),
            "worker_reads": CounterMetricFamily(
                "lora_adapter_worker_reads", "Cache misses read on the worker while its batch waited.", labels=labels
            ),
        }
        info = GaugeMetricFamily(
            "lora_requests_info",
            "Running and waiting adapters per replica (vLLM's lora_requests_info); the value is the state's time.",
            labels=["replica", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        for replica, state in sorted(self.states.items()):
            for key, family in families.items():
                family.add_metric([replica], state[key])
            running, waiting = ",".join(state["running"]), ",".join(state["waiting"])
            info.add_metric([replica, running, waiting, str(state["max_lora"])], state["time"])
        yield from families.values()
        yield info


class ServeMetrics:
    """The ingress's metrics; `text()` is the scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.replicas = ReplicaCollector()
        self.registry.register(self.replicas)
        self.requests = Counter(
            "lora_requests",
            "HTTP generation requests by route, adapter and outcome.",
            ["route", "adapter", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "lora_request_latency_seconds",
            "Seconds from a request's arrival to its answer.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "lora_batch_size", "Pipeline batch each image ran in.", buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.swap = Histogram(
            "lora_swap_seconds",
            "Seconds the engine spent swapping adapters before each image's batch.",
            buckets=SWAP_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "lora_ingress_in_flight", "Images the ingress is waiting on (running or queued).", registry=self.registry
        )

    def observe_answer(self, info: dict[str, Any], state: dict[str, Any] | None) -> None:
        """One image's info (`Result.info`) and the state of the replica that made it."""
        self.batch_size.observe(info.get("batch_size", 1))
        self.swap.observe(info.get("swap_ms", 0.0) / 1e3)
        if state:
            self.observe_state(state)

    def observe_state(self, state: dict[str, Any]) -> None:
        current = self.replicas.states.get(state["replica"])
        if current is None or current["time"] <= state["time"]:
            self.replicas.states[state["replica"]] = state

    def text(self) -> bytes:
        return generate_latest(self.registry)
