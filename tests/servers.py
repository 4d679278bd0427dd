"""`python -m lora_manager serve ...` as a user starts it, in its own process group, stopped and cleaned up after."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 300  # a local Ray instance and the replicas' pipelines, on a 2-core CPU


@contextlib.contextmanager
def running_serve(args: list[str], port: int, log: Path) -> Iterator[str]:
    """Start `python -m lora_manager serve *args` (its output in `log`); yield its URL once GET /info answers."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lora_manager", "serve", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _answers(f"{url}/info"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start (rc={proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ray's driver shuts its local instance down on SIGINT
        try:
            proc.wait(20)  # waiting longer does not help a driver still up by then: the group is killed next
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False
