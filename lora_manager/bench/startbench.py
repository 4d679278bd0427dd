"""How long `python app.py` takes to be ready on a machine that has never compiled, eager against compiled.

Each start runs in a fresh process with an empty inductor cache (`TORCHINDUCTOR_CACHE_DIR`) and an empty temp
directory (`TMPDIR`: inductor keeps its precompiled C++ headers there, outside its cache), as on a restarted Space or a
new laptop. Eager and compiled starts alternate and swap order every round, so a busy minute on a shared CPU hits both.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

from ..testing import running_app

APP = Path(__file__).resolve().parents[2] / "app.py"  # a checkout's app: the command measures the app as users run it
READY = re.compile(r"ready in ([0-9.]+) s .*compiled: (.*), \d+ adapters; (.*)\)$")
MODES = {"eager": "--no-compile", "compiled": "--compile"}


@dataclass
class Start:
    mode: str  # "eager" or "compiled"
    ready_s: float  # the app's own "ready in" (from its first line of Python to a serving UI)
    wall_s: float  # from spawning the process to seeing that line (adds the interpreter's start)
    compile_source: str  # what the app says about its compile: "eager", "artifacts (...)", "compiled (...)"
    phases: str  # the start-up phases the app lists


def start_once(mode: str, preset: str, threads: int | None, timeout_s: float = 900) -> Start:
    """Start the app with empty torch caches until it prints its "ready in" line, then stop it."""
    if not APP.is_file():
        raise SystemExit(f"startbench measures the app of a checkout: {APP} not found")
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TMPDIR": tmp, "GRADIO_ANALYTICS_ENABLED": "False"}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        env.pop("LORA_COMPILE", None)
        t0 = time.perf_counter()
        with running_app(APP, [MODES[mode], "--preset", preset], env, timeout_s) as (_, line):
            wall_s = time.perf_counter() - t0
    if not (match := READY.search(line.strip())):
        raise RuntimeError(f"app.py {MODES[mode]}: a ready line this benchmark cannot read: {line!r}")
    ready_s, source, phases = match.groups()
    return Start(mode, float(ready_s), wall_s, source, phases)


def measure(rounds: int, preset: str = "tiny", threads: int | None = None) -> dict:
    """`rounds` eager/compiled pairs, order swapped every round; the ratio of each pair and their median."""
    starts, ratios = [], []
    for r in range(rounds):
        order = ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")
        pair = {mode: start_once(mode, preset, threads) for mode in order}
        starts += [asdict(pair[mode]) for mode in order]
        ratios.append(round(pair["compiled"].ready_s / pair["eager"].ready_s, 2))
        print(
            f"round {r + 1}: eager {pair['eager'].ready_s:.1f} s, compiled {pair['compiled'].ready_s:.1f} s "
            f"({ratios[-1]}x; {pair['compiled'].compile_source})",
            file=sys.stderr,
            flush=True,
        )
    return {"preset": preset, "threads": threads, "starts": starts, "ratios": ratios, "median_ratio": median(ratios)}


def main(rounds: int, preset: str, threads: int | None, out: Path | None) -> None:
    if rounds < 1:
        raise SystemExit("--rounds 0: measure at least one pair")
    result = json.dumps(measure(rounds, preset, threads), indent=2)
    if out:
        out.write_text(result + "\n")
    print(result)
