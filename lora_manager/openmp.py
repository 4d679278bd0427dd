"""Keeps one thread at a time with a pool of OpenMP threads (GNU libgomp, the runtime of PyTorch's Linux wheels) on
the CPU: the engine's worker while it serves.

libgomp lets idle pool threads spin for the next parallel region only while it manages no more threads than there
are CPUs. A second pool, such as the one the thread that loaded the pipeline keeps, tips it over: every pool then
sleeps and is woken between regions, which a pipeline of many small operations pays for at every one of them
(`docs/performance.md`). Threads that ran torch work free their pool (`release_idle_threads`), as the worker does
whenever its queue is empty, and background threads never start one (`one_thread`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

OMP_PAUSE_SOFT = 1


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded, once torch (which loads it) is imported; None without one, or off Linux.
    Other runtimes pause every thread's pool rather than the caller's, so they are left alone."""
    return _find_libgomp() if "torch" in sys.modules else None


@functools.cache
def _find_libgomp() -> ctypes.CDLL | None:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(p for p in paths if os.path.basename(p).startswith("libgomp")):
        lib = ctypes.CDLL(path)
        if hasattr(lib, "omp_pause_resource_all"):  # OpenMP 5.0
            lib.omp_pause_resource_all.argtypes, lib.omp_set_num_threads.argtypes = [ctypes.c_int], [ctypes.c_int]
            return lib
    return None


def release_idle_threads() -> None:
    """Free the calling thread's idle OpenMP threads, if it has any; it gets new ones if it runs parallel work
    again."""
    lib = _libgomp()
    if lib is not None:
        lib.omp_pause_resource_all(OMP_PAUSE_SOFT)


def one_thread() -> None:
    """Run the calling thread's torch operations on that thread alone, with no pool: for background threads (adapter
    reads). torch sets a thread's count on its first parallel call, so that happens first; a process that has not
    imported torch has no pools to keep apart."""
    lib = _libgomp()
    if lib is not None:
        sys.modules["torch"].get_num_threads()
        lib.omp_set_num_threads(1)
