"""The engine keeps its worker the only thread with OpenMP threads (`lora_manager/openmp.py`): a thread that ran
parallel torch work frees its pool, and a background thread runs without one."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lora_manager.openmp import _libgomp, one_thread, release_idle_threads

pytestmark = pytest.mark.skipif(
    _libgomp() is None or torch.get_num_threads() < 2, reason="needs libgomp (Linux) and two torch threads"
)
PARALLEL = 1 << 22  # elements: far above torch's grain size, so an elementwise op runs on the thread's pool


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
        seen["before"] = threads()
        torch.ones(PARALLEL).mul_(2)
        seen["pool"] = threads()
        release_idle_threads()
        seen["released"] = threads()
        release_idle_threads()  # nothing left to free: a no-op
        seen["again"] = threads()

    seen = in_thread(body)
    assert seen["pool"] == seen["before"] + torch.get_num_threads() - 1
    assert seen["released"] == seen["again"] == seen["before"]


def test_a_background_thread_runs_its_torch_work_without_a_pool():
    def body(seen):
        one_thread()
        seen["before"], seen["count"] = threads(), torch.get_num_threads()
        torch.ones(PARALLEL).mul_(2)
        seen["after"] = threads()

    count = torch.get_num_threads()
    seen = in_thread(body)
    assert seen["count"] == 1 and seen["after"] == seen["before"]
    assert torch.get_num_threads() == count  # the other threads keep theirs
