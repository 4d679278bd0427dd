"""The CPU cache under skewed traffic, and misses read off the worker thread: a slow Hub download or a file that
turned corrupt delays or fails only the requests that named that adapter (tests/test_cache_unit.py: the policy)."""

from __future__ import annotations

import random
import shutil
import statistics
import threading
import time
from collections import OrderedDict

import pytest
import torch

from lora_manager import LoraManager, LoraManagerError
from lora_manager.adapters.reader import AdapterWeights, ModuleLora
from lora_manager.adapters.sources import hub_cache_files, remove_files
from lora_manager.adapters.store import AdapterStore
from lora_manager.bench import skewed
from lora_manager.images import levels

from engine_helpers import (
    assert_same_slots,
    break_while_evicted,
    evict_all_but,
    load_tiny,
    make_catalog,
    snapshot_slots,
)
from helpers import PROMPT
from hub_server import HubServer, Repo, hub_env

STEPS = 2  # every request here: the latency compared is the engine's own, not the image's


def zipf_trace(n_adapters: int, n_requests: int, s: float, seed: int) -> list[str]:
    order = list(range(n_adapters))
    random.Random(seed).shuffle(order)  # popularity unrelated to the ids' order
    return [f"a{order[k]}" for k in skewed.zipf_trace(n_adapters, n_requests, s, seed)]


def tiny_weights(seed: int) -> AdapterWeights:
    g = torch.Generator().manual_seed(seed)
    module = ModuleLora(A=torch.randn(4, 8, generator=g), B=torch.randn(8, 4, generator=g), alpha=4.0, scale=1.0)
    return AdapterWeights({("unet", "attn.to_q"): module}, format="peft")


def lru_misses(trace: list[str], capacity: int) -> int:
    cache: OrderedDict[str, None] = OrderedDict()
    misses = 0
    for adapter_id in trace:
        if adapter_id in cache:
            cache.move_to_end(adapter_id)
            continue
        misses += 1
        cache[adapter_id] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return misses


def test_the_cache_keeps_the_hot_set_under_zipf_traffic():
    """300 adapters, Zipf(1.1) requests, a cache of 10% of their bytes, one live adapter at a time: far fewer misses
    than LRU, never over budget, and a newcomer that is not kept leaves nothing behind once it is not live."""
    trace = zipf_trace(300, 4000, 1.1, seed=5)
    evicted: list[str] = []
    store = AdapterStore(30 * tiny_weights(0).nbytes, on_evict=lambda i, _: evicted.append(i))
    weights = {f"a{i}": tiny_weights(i) for i in range(300)}
    live = None
    for adapter_id in trace:
        store.record(adapter_id)
        if store.get(adapter_id) is None:
            store.put(adapter_id, weights[adapter_id])
        store.pin(adapter_id)
        if live not in (None, adapter_id):
            store.unpin(live)
        live = adapter_id
        assert store.nbytes <= store.budget_bytes and store.report()["cache_guests"] <= 1
    misses, lru = store.stats.misses, lru_misses(trace, 30)
    print(f"misses: {misses} TinyLFU, {lru} LRU over {len(trace)} requests; rejected {store.stats.rejected}")
    assert misses < 0.85 * lru
    store.unpin(live)
    assert store.report()["cache_guests"] == 0 and store.stats.rejected > 0
    assert len(evicted) == store.stats.evictions + store.stats.rejected  # every newcomer not kept was let go


@pytest.fixture(scope="module")
def slow_hub(adapter_dir):
    """A local Hub serving a copy of one test adapter; its file's download can be made slow."""
    blob = (adapter_dir / "r16_half.safetensors").read_bytes()
    with HubServer({"owner/slow": Repo({"main": {"lora.safetensors": blob}})}, slow_s=3.0) as hub:
        yield hub


def latencies(m: LoraManager, adapter: str, n: int | None = None, until: threading.Event | None = None) -> list[float]:
    """Seconds each of `n` requests for `adapter` took, one after another (or as many as run until `until`)."""
    out = []
    while (n is not None and len(out) < n) or (until is not None and not until.is_set()):
        t0 = time.perf_counter()
        m.generate(PROMPT, adapter=adapter, steps=STEPS)
        out.append(time.perf_counter() - t0)
    return out


def test_a_slow_download_delays_only_its_own_request(adapter_dir, slow_hub, tmp_path, monkeypatch):
    """The adapter's Hub file is gone from the local cache and it was evicted from the CPU cache: its next request
    downloads it again, which takes 3 s. Requests for the resident adapter sent meanwhile run at their usual
    latency (within 1.3x of a baseline measured just before); the slow one then succeeds with its file's image.
    Mixed batches (max_batch 4), as served under load; test_scheduler_unit covers one request at a time."""
    hub_env(monkeypatch, HF_ENDPOINT=slow_hub.url, HF_HOME=str(tmp_path / "hf_home"))
    m = LoraManager(load_tiny(), make_catalog(adapter_dir, ("r4_attn", "r16_half", "r6_te")), max_batch=4)
    m.register("slow", "owner/slow")  # the same file as r16_half
    m.generate(PROMPT, adapter="r4_attn", steps=STEPS)
    evict_all_but(m, adapter_dir, ("r4_attn",))
    assert m.info("slow").status == "evicted"
    remove_files(hub_cache_files("owner/slow"))
    slow_hub.repos["owner/slow"].file_faults["lora.safetensors"] = "slow"
    try:
        baseline = latencies(m, "r4_attn", n=13)[1:]  # the first one swaps r4_attn back in
        t0 = time.perf_counter()
        slow = m.submit(PROMPT, adapter="slow", steps=STEPS, output_type="np")
        done = threading.Event()
        slow.add_done_callback(lambda _: done.set())
        during = latencies(m, "r4_attn", until=done)
        waited = time.perf_counter() - t0
        result = slow.result(timeout=30)
        same_file = m.generate(PROMPT, adapter="r16_half", steps=STEPS, output_type="np").image
    finally:
        slow_hub.repos["owner/slow"].file_faults.clear()
        m.close()
    usual = statistics.median(baseline)
    print(f"usual {usual * 1e3:.0f} ms; during the download {[round(t * 1e3) for t in during]} ms; slow {waited:.1f} s")
    assert waited >= slow_hub.slow_s and len(during) >= 3
    assert statistics.median(during) <= 1.3 * usual
    assert max(during) < slow_hub.slow_s / 2  # none of them waited for the download
    assert levels(result.image, same_file) <= 1
    stats = m.stats()
    assert stats["background_loads"] >= 1 and stats["worker_reads"] == 0


def test_a_file_that_turned_corrupt_fails_only_its_requests(adapter_dir, tmp_path):
    """Two requests name an evicted adapter whose file was emptied since: both fail with its error after a single
    read, the resident adapter's requests queued around them are served, and the live adapter is untouched."""
    victim = tmp_path / "victim.safetensors"
    shutil.copy(adapter_dir / "r4_attn.safetensors", victim)
    with LoraManager(load_tiny(), make_catalog(adapter_dir, ("r4_attn", "r6_te"))) as m:
        m.register("victim", str(victim))
        m.generate(PROMPT, adapter="r4_attn", steps=STEPS)
        break_while_evicted(m, adapter_dir, victim, ("r4_attn",))
        slots = snapshot_slots(m)
        gate, running = threading.Event(), threading.Event()

        def hold(pipe, step, timestep, kwargs):
            running.set()
            gate.wait()
            return kwargs

        blocker = m.submit(PROMPT, "r4_attn", steps=STEPS, callback_on_step_end=hold)
        running.wait()  # the worker is busy: both requests for the victim are queued before its read can fail them
        futures = [m.submit(PROMPT, a, seed=i, steps=STEPS) for i, a in enumerate(["victim", "r4_attn"] * 2)]
        gate.set()
        blocker.result()
        for future, adapter in zip(futures, ["victim", "r4_attn"] * 2, strict=True):
            if adapter == "victim":
                with pytest.raises(LoraManagerError, match="'victim'"):
                    future.result()
            else:
                assert future.result().info["adapter"] == "r4_attn"
        assert_same_slots(slots, snapshot_slots(m))
        stats = m.stats()
        assert stats["background_load_failures"] == 1 and stats["worker_reads"] == 0
