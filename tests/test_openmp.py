"""The engine keeps its worker the only thread with OpenMP threads (`lora_manager/openmp.py`): a thread that ran
parallel torch work frees its pool, and a background thread runs without one."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lora_manager.openmp import _libgomp, one_thread, release_idle_threads

pytestmark = pytest.mark.skipif(_libgomp() is None, reason="needs libgomp, the OpenMP runtime of torch's Linux wheels")
PARALLEL = 1 << 22  # elements: far above torch's grain size, so an elementwise op runs on the thread's pool
POOL = 2  # torch threads in the tests' own threads (a pool of one helper), whatever the process was started with


@pytest.fixture(autouse=True)
def restore_thread_count():
    count = torch.get_num_threads()
    yield
    torch.set_num_threads(count)


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def in_thread(body) -> dict:
    seen: dict = {}
    thread = threading.Thread(target=body, args=(seen,))
    thread.start()
    thread.join()
    return seen


def test_a_thread_that_ran_parallel_work_frees_its_openmp_threads():
    def body(seen):
        torch.set_num_threads(POOL)
        seen["before"] = threads()
        torch.ones(PARALLEL).mul_(2)
        seen["pool"] = threads()
        release_idle_threads()
        seen["released"] = threads()
        release_idle_threads()  # nothing left to free: a no-op
        seen["again"] = threads()

    seen = in_thread(body)
    assert seen["pool"] == seen["before"] + POOL - 1
    assert seen["released"] == seen["again"] == seen["before"]


def test_a_background_thread_runs_its_torch_work_without_a_pool():
    torch.set_num_threads(POOL)  # what a new thread would start with

    def body(seen):
        one_thread()
        seen["before"], seen["count"] = threads(), torch.get_num_threads()
        torch.ones(PARALLEL).mul_(2)
        seen["after"] = threads()

    seen = in_thread(body)
    assert seen["count"] == 1 and seen["after"] <= seen["before"]  # no pool started (another thread may have ended)
    assert torch.get_num_threads() == POOL  # the other threads keep theirs
