"""The CPU cache's policy alone: the frequency sketch, which victims a newcomer may evict, and the bounded background
loader that reads missed adapters off the worker thread (tests/test_cache.py runs the cache itself)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from lora_manager.adapters.admission import MAX_COUNT, Entry, FrequencySketch, choose_victims
from lora_manager.adapters.loader import AdapterLoader

pytestmark = pytest.mark.unit


def test_sketch_counts_requests_and_halves_them_after_its_sample():
    sketch = FrequencySketch(width=64, sample=200)
    for i in range(40):
        sketch.record("hot")
        if i % 4 == 0:
            sketch.record("warm")
    assert sketch.estimate("hot") == MAX_COUNT  # saturated
    assert sketch.estimate("warm") == 10
    assert sketch.estimate("never") == 0
    for i in range(200 - 50):  # the sample fills: every count halves
        sketch.record(f"other{i % 7}")
    assert sketch.estimate("warm") == 5 and sketch.estimate("hot") == MAX_COUNT // 2


def test_victims_are_the_coldest_then_the_least_recent():
    entries = [Entry("a", 10, 3), Entry("b", 10, 1), Entry("c", 10, 1), Entry("d", 10, 5)]  # least recent first
    assert choose_victims(4, 15, entries) == ["b", "c"]
    assert choose_victims(4, 0, entries) == []


def test_a_newcomer_evicts_only_colder_adapters_unless_registered():
    entries = [Entry("a", 10, 3), Entry("b", 10, 1)]
    assert choose_victims(3, 15, entries) is None  # "a" is as hot as the newcomer
    assert choose_victims(1, 5, entries) is None  # "b" too
    assert choose_victims(4, 15, entries) == ["b", "a"]
    assert choose_victims(0, 15, entries, always=True) == ["b", "a"]
    assert choose_victims(9, 25, entries) is None  # evicting everything still leaves no room


def gated_loader(**kw) -> tuple[AdapterLoader, dict[str, threading.Event], list[str], threading.Semaphore]:
    """A loader whose read of `x` waits for gates[x] and fails for ids starting with "bad"; `order` records reads as
    they start, `done` is released once per finished read."""
    gates: dict[str, threading.Event] = {}
    order: list[str] = []
    done = threading.Semaphore(0)

    def read(adapter_id: str) -> str:
        order.append(adapter_id)
        gates.setdefault(adapter_id, threading.Event()).wait(5)
        if adapter_id.startswith("bad"):
            raise ValueError(f"{adapter_id} is corrupt")
        return f"weights of {adapter_id}"

    loader = AdapterLoader(read, lambda a: a == "cached", **kw)
    loader.on_done = done.release
    for name in ("a", "b", "c", "bad"):
        gates[name] = threading.Event()
    return loader, gates, order, done


def settled(condition, timeout: float = 5.0) -> bool:
    """Whether `condition()` holds within `timeout` (a read starts on its own thread)."""
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.005)
    return condition()


def test_loader_reads_in_order_within_its_bounds():
    loader, gates, order, done = gated_loader(max_loads=2, max_ready=3)
    loader.want(["cached", "a", "b", "c"])
    assert loader.report()["loads_in_flight"] == 2
    assert settled(lambda: sorted(order) == ["a", "b"])  # "cached" needs no read, "c" waits for room
    assert loader.ready("cached") and not loader.ready("a")
    gates["a"].set()
    assert done.acquire(timeout=5)
    assert loader.ready("a")
    loader.want(["a", "b", "c"])  # one read finished: room for "c" (2 in flight + 1 ready = max_ready 3)
    assert settled(lambda: order[2:] == ["c"])
    assert loader.take("a") == "weights of a" and loader.take("a") is None
    gates["b"].set()
    gates["c"].set()
    assert done.acquire(timeout=5) and done.acquire(timeout=5)
    loader.keep_only({"c"})  # nobody waits for "b" any more
    assert not loader.ready("b") and loader.ready("c")
    assert loader.report() == {
        "background_loads": 3,
        "background_load_failures": 0,
        "loads_in_flight": 0,
        "loads_ready": 1,
    }


def test_a_failed_read_is_handed_over_once_and_read_again_when_asked():
    loader, gates, order, done = gated_loader()
    gates["bad"].set()
    loader.want(["bad"])
    assert done.acquire(timeout=5)
    assert not loader.ready("bad")
    loader.want(["bad"])  # a failure waiting for its requests is not read again
    assert order == ["bad"]
    failures = loader.failures()
    assert list(failures) == ["bad"] and "corrupt" in str(failures["bad"])
    assert loader.failures() == {}
    loader.want(["bad"])
    assert done.acquire(timeout=5) and order == ["bad", "bad"]
    with pytest.raises(ValueError, match="corrupt"):
        loader.take("bad")
    assert loader.report()["background_load_failures"] == 2


def test_a_forked_child_starts_with_no_reads_and_reads_on_its_own():
    """ZeroGPU forks the process for each GPU call: the parent's read in flight has no thread in the child."""
    loader, gates, order, done = gated_loader()
    loader.want(["a"])  # held by its gate in the parent
    pid = os.fork()
    if pid == 0:  # the child: nothing in flight, and a read of its own finishes
        gates["b"].set()
        state = loader.report()
        loader.want(["a", "b"])
        ok = state["loads_in_flight"] == 0 and done.acquire(timeout=5) and loader.take("b") == "weights of b"
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert loader.report()["loads_in_flight"] == 1  # the parent's read is still its own
    gates["a"].set()
    assert done.acquire(timeout=5) and loader.take("a") == "weights of a"
