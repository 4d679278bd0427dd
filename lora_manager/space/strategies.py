"""The Strategies tab: `python -m lora_manager bench` on the embedded model, in a process of its own."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import gradio as gr

import lora_manager
from lora_manager.request_schema import shorten
from lora_manager.space.refusals import Refusal

log = logging.getLogger("app")
STRATEGIES_TIMEOUT_S = 600
_STRATEGIES_LOCK = threading.Lock()  # one measurement at a time, in a process of its own


def strategies(repeats: int, progress=gr.Progress()):
    """Time every way of switching adapters on fresh copies of the embedded model, in a process of its own (one
    torch thread; never the live pipeline), one measurement at a time: a second caller is told to retry.

    Args:
        repeats: measurements per strategy, 2 to 20; the median is reported.
    Returns:
        the chart, a table of median milliseconds per switch, and the full report.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, (int, float)) or not 2 <= repeats <= 20:
        raise Refusal(f"repeats must be a number between 2 and 20, got {shorten(repeats)}.")
    if not _STRATEGIES_LOCK.acquire(blocking=False):
        raise Refusal("A measurement is already running; retry in a minute, when it has finished.", title="Busy")
    try:
        progress(0, desc="measuring reload, set_adapters, diffusers hotswap and the engine's swap")
        report = _run_bench(int(repeats))
        from lora_manager.bench import bench  # matplotlib: loaded when the tab is used, not at start-up

        floor = report["results"]["floor_per_tensor_ms"]
        rows = [[k.removesuffix("_ms"), round(v, 3), round(v / floor, 2)] for k, v in report["results"].items()]
        return bench.make_figure(report), rows, report
    finally:
        _STRATEGIES_LOCK.release()


def _run_bench(repeats: int) -> dict:
    """`python -m lora_manager bench` in a child process: its models, memory and threads never touch the server's."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "lora_manager",
            "bench",
            "--scale",
            "tiny",
            "--repeats",
            str(repeats),
            "--device",
            "cpu",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=STRATEGIES_TIMEOUT_S,
                cwd=Path(lora_manager.__file__).resolve().parents[1],
            )
        except subprocess.TimeoutExpired as e:
            raise gr.Error(f"The measurement took longer than {STRATEGIES_TIMEOUT_S} s and was stopped.") from e
        if done.returncode != 0 or not out.is_file():
            log.error("bench failed (%s): %s", done.returncode, done.stderr[-2000:])
            raise gr.Error("The measurement failed; the server log has the details.")
        return json.loads(out.read_text())
