"""The scheduler alone, on a stand-in for the engine that returns each request's seed: grouping by adapter,
fairness, mixed batches within the device slots and the queue limit (test_fresh_machine.py serves 10,000 requests)."""

from __future__ import annotations

import threading
import time

import pytest

from lora_manager.adapters.loader import AdapterLoader
from lora_manager.errors import QueueFullError
from lora_manager.layout import Layout
from lora_manager.scheduler import Request, Scheduler

pytestmark = pytest.mark.unit


def gated_scheduler(gate: threading.Event, **kw) -> tuple[Scheduler, list[list[Request]]]:
    """A scheduler whose batches wait for `gate`, then make their adapters the live ones; the batches it ran, in
    order, are in the returned list."""
    batches: list[list[Request]] = []
    live = {"adapters": frozenset()}

    def run(batch: list[Request]):
        gate.wait()
        live["adapters"] = frozenset().union(*(r.adapter_ids for r in batch))
        batches.append(batch)
        return [r.seed for r in batch]

    return Scheduler(run, lambda: live["adapters"], **kw), batches


def test_scheduler_groups_by_adapter_and_never_starves_one():
    gate = threading.Event()
    s, batches = gated_scheduler(gate, max_consecutive=3)
    first = s.submit(Request("p", (("a", 1.0),), 0))
    time.sleep(0.05)  # the worker now holds `first` at the gate
    arrivals = ["b", "a", "b", "a", "c", "a", "a", "a", "a"]
    futures = [s.submit(Request("p", ((x, 1.0),), i + 1)) for i, x in enumerate(arrivals)]
    gate.set()
    assert [f.result(timeout=5) for f in futures] == list(range(1, len(arrivals) + 1))
    first.result(timeout=5)
    order = [r.adapters[0][0] for batch in batches for r in batch]
    served = order[1:]
    changes = sum(x != y for x, y in zip(order, order[1:], strict=False))
    assert changes < sum(
        x != y for x, y in zip(["a", *arrivals], arrivals, strict=False)
    )  # fewer swaps than arrival order
    streak = 1
    for i in range(1, len(order)):
        streak = streak + 1 if order[i] == order[i - 1] else 1
        if streak > 3:  # longer runs of one adapter only once nobody else is waiting
            assert set(order[i:]) == {order[i]}, order
    assert served.index("b") <= 3 and served.index("c") <= 7


def test_full_queue_answers_busy_at_once():
    gate = threading.Event()
    s, _ = gated_scheduler(gate, max_queue=2)
    s.submit(Request("p", (("a", 1.0),), 0))
    time.sleep(0.05)
    s.submit(Request("p", (("a", 1.0),), 1))
    s.submit(Request("p", (("b", 1.0),), 2))
    with pytest.raises(QueueFullError, match="Busy: 2 requests are queued .* retry"):
        s.submit(Request("p", (("c", 1.0),), 3))
    gate.set()


def test_scheduler_mixes_adapters_within_max_batch_device_slots_and_equal_params():
    gate = threading.Event()
    s, batches = gated_scheduler(gate, layout=Layout.of(max_batch=3, device_slots=2))
    s.submit(Request("p", (("a", 1.0),), 0))
    time.sleep(0.05)  # the worker now holds request 0 at the gate
    arrivals = [("b", {}), ("c", {}), ("d", {}), ("a", {"num_inference_steps": 3}), ("a", {}), ("e", {})]
    futures = [s.submit(Request("p", ((x, 1.0),) if x else (), i + 1, p)) for i, (x, p) in enumerate(arrivals)]
    gate.set()
    assert [f.result(timeout=5) for f in futures] == list(range(1, len(arrivals) + 1))
    # live {a}: the live adapter's requests first (4 alone: other steps), then 5 with b (2 device slots, not 3),
    # then the oldest (c) with d, then e
    assert [[r.seed for r in batch] for batch in batches[1:]] == [[4], [5, 1], [2, 3], [6]]
    assert s.stats.batches == 5


def test_scheduler_fairness_holds_with_mixed_batches():
    gate = threading.Event()
    s, batches = gated_scheduler(gate, layout=Layout.of(max_batch=2), max_consecutive=2)
    s.submit(Request("p", (("a", 1.0),), 0))
    time.sleep(0.05)
    futures = [s.submit(Request("p", (("z", 1.0),), 1, {"num_inference_steps": 3}))]  # shares a batch with nobody
    futures += [s.submit(Request("p", (("a", 1.0),), i)) for i in range(2, 10)]
    gate.set()
    [f.result(timeout=5) for f in futures]
    seeds = [[r.seed for r in batch] for batch in batches]
    assert [1] in seeds[: 1 + 3]  # served within max_consecutive batches of the live adapter's requests


def loading_scheduler(resident: set[str], **kw) -> tuple[Scheduler, dict[str, threading.Event], list[list[Request]]]:
    """A scheduler whose requests need their adapters `resident` or read by a real AdapterLoader; the read of `x`
    waits for gates[x] and fails for ids starting with "bad". Batches run at once."""
    gates: dict[str, threading.Event] = {}
    batches: list[list[Request]] = []

    def read(adapter_id: str) -> str:
        gates.setdefault(adapter_id, threading.Event()).wait(10)
        if adapter_id.startswith("bad"):
            raise ValueError(f"{adapter_id} is corrupt")
        resident.add(adapter_id)
        return adapter_id

    def run(batch: list[Request]):
        batches.append(batch)
        return [r.seed for r in batch]

    loader = AdapterLoader(read, resident.__contains__)
    s = Scheduler(run, frozenset, loads=loader, **kw)
    loader.on_done = s.wake
    return s, gates, batches


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_request_whose_adapter_is_read_does_not_hold_up_resident_ones(max_batch):
    s, gates, batches = loading_scheduler({"a", "b"}, layout=Layout.of(max_batch=max_batch))
    slow = s.submit(Request("p", (("slow", 1.0),), 0))
    served = [s.submit(Request("p", ((x, 1.0),), i)).result(timeout=5) for i, x in enumerate("abab", start=1)]
    assert served == [1, 2, 3, 4] and not slow.done()  # the resident ones ran while "slow" was being read
    gates.setdefault("slow", threading.Event()).set()
    assert slow.result(timeout=5) == 0
    assert [r.seed for r in batches[-1]] == [0]


def test_a_failed_read_fails_exactly_the_requests_that_named_it():
    s, gates, batches = loading_scheduler({"a"})
    bad = [s.submit(Request("p", (("bad", 1.0),), 0)), s.submit(Request("p", (("bad", 1.0), ("a", 1.0)), 1))]
    good = s.submit(Request("p", (("a", 1.0),), 2))
    assert good.result(timeout=5) == 2
    gates.setdefault("bad", threading.Event()).set()
    for future in bad:
        with pytest.raises(ValueError, match="bad is corrupt"):
            future.result(timeout=5)
    assert s.submit(Request("p", (("a", 1.0),), 3)).result(timeout=5) == 3
    assert all(r.seed in (2, 3) for batch in batches for r in batch)
