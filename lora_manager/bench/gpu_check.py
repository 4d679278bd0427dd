"""`python -m lora_manager gpu-check`: what only a GPU shows about the engine, in one offline run.

Half precision on CUDA kernels (float16, bfloat16), compiled graphs that survive swaps, two-adapter requests and mixed
batches without one recompile, swap latency, and throughput against plain diffusers; on the tiny preset and on small
random-weight SDXL and Flux pipelines built from config, so nothing is downloaded, and (`sdxl-real`) the real-width
benchmark's rows (`real_width.py`). Each case runs in its own process under a time limit, so one that stalls costs
only its limit; its row is printed the moment it ends and the JSON is rewritten after every case. A failing case is
shown in its row and makes the command exit non-zero.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import diffusers
import numpy as np
import torch
import transformers
from diffusers import DiffusionPipeline

from ..adapters.inspection import ATTENTION, BLOCKS
from ..engine import LoraManager
from ..options import APP_MAX_BATCH, APP_SLOTS
from ..specs import AdapterSpec, Catalog, Result
from ..testing import write_adapter
from .mini_pipelines import FLUX_GEN, SDXL_GEN, mini_flux, mini_sdxl

PROMPT = "a red circle on a blue background"
ENGINE = {"max_batch": APP_MAX_BATCH, "slots": APP_SLOTS}  # as the app runs it
TIMED = 3  # single requests timed on the engine, and calls on plain diffusers (their median is reported)
# the mini pipelines' adapters: different ranks, alphas and targets (attention, whole blocks, + text encoder, ff only)
ADAPTERS = {
    "attn_r4": {"rank": 4, "alpha": 4, "suffixes": ATTENTION, "seed": 1},
    "blocks_r8": {"rank": 8, "alpha": 16, "suffixes": BLOCKS, "seed": 2},
    "attn_te_r6": {"rank": 6, "alpha": 3, "suffixes": ATTENTION, "te_rank": 4, "te_alpha": 8, "seed": 3},
    "ff_r16": {"rank": 16, "alpha": 8, "suffixes": ("ff.net.0.proj", "ff.net.2"), "seed": 4},
}

# a case's engine, and how to build a fresh pipeline of the same weights for plain diffusers
Engine = tuple[LoraManager, Callable[[], DiffusionPipeline]]
Start = Callable[[str, torch.dtype, bool, Path], Engine]


@dataclass
class Row:
    """One case's results, filled in as it runs: a failed case still shows what it measured before the failure."""

    case: str
    dtype: str = ""
    compile_s: float | None = None
    compile_source: str = ""
    recompiles: int | None = None
    swap_ms_median: float | None = None
    engine_img_s: float | None = None  # single requests, one pipeline call each (`generate_ms`)
    batch_img_s: float | None = None  # one mixed batch of ENGINE["max_batch"] requests, different adapters
    diffusers_img_s: float | None = None  # plain diffusers, one LoRA by load_lora_weights, eager
    finite: bool | None = None  # every image of the case, engine's and plain diffusers', without NaN or inf
    real_width: dict | None = None  # `sdxl-real`: the real-width benchmark's medians and ratios
    seconds: float | None = None  # the case's process, start to end
    error: str | None = None

    @property
    def ok(self) -> bool:
        images = self.finite is True or (self.real_width is not None and self.finite is None)
        return self.error is None and self.recompiles == 0 and images


def start_tiny(device: str, dtype: torch.dtype, compile: bool, folder: Path) -> Engine:
    """The shipped tiny preset and its own adapters (ranks 4 to 32, conv-only, kohya keys, a text encoder part)."""
    m = LoraManager.from_preset("tiny", compile=compile, device=device, dtype=dtype, **ENGINE)

    def fresh() -> DiffusionPipeline:
        pipe = DiffusionPipeline.from_pretrained(m.base_model, dtype=dtype).to(device)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    return m, fresh


def mini_case(build: Callable[..., DiffusionPipeline], generation: dict) -> Start:
    """A mini pipeline with ADAPTERS written for it; plain diffusers gets a second build of the same weights."""

    def start(device: str, dtype: torch.dtype, compile: bool, folder: Path) -> Engine:
        writer = build()  # float32 on the CPU: the files hold float32 weights, as published LoRAs mostly do
        specs = tuple(
            AdapterSpec(id=name, source=str(write_adapter(writer, folder / f"{name}.safetensors", **kw)))
            for name, kw in ADAPTERS.items()
        )
        catalog = Catalog(
            name=build.__name__, base_model=f"{build.__name__} (random weights)", adapters=specs, generation=generation
        )
        m = LoraManager(build(dtype=dtype, device=device), catalog, compile=compile, **ENGINE)
        return m, lambda: build(dtype=dtype, device=device)

    return start


CASES: dict[str, tuple[torch.dtype, Start | None]] = {
    "tiny": (torch.float16, start_tiny),
    "sdxl": (torch.float16, mini_case(mini_sdxl, SDXL_GEN)),
    "flux": (torch.bfloat16, mini_case(mini_flux, FLUX_GEN)),
    "sdxl-real": (torch.float16, None),  # `real_width.run`
}
CASE_TIMEOUT_S = 150.0


def finite(images: list[np.ndarray]) -> bool:
    return all(np.isfinite(image).all() for image in images)


def images_per_s(results: list[Result]) -> float:
    """From the pipeline call's own time (`generate_ms`, which a batch's rows share), as plain diffusers is timed;
    the median call, so one call slowed by something else on the machine does not count."""
    return 1e3 / statistics.median(r.info["generate_ms"] / r.info["batch_size"] for r in results)


def mixed_batch(m: LoraManager, adapters: list[str], settings: dict) -> list[Result]:
    """One request per adapter, queued while a first request holds the worker, so the scheduler takes them all as
    one batch (as `run_together` in tests/test_mixed_batches.py does)."""
    gate = threading.Event()
    blocker = m.submit(PROMPT, callback_on_step_end=lambda *a: (gate.wait(), a[3])[1])
    try:
        futures = [m.submit(PROMPT, adapter=a, seed=10 + i, **settings) for i, a in enumerate(adapters)]
    finally:
        gate.set()
    blocker.result()
    results = [f.result() for f in futures]
    sizes = sorted({r.info["batch_size"] for r in results})
    if sizes != [len(adapters)]:
        raise RuntimeError(f"the mixed batch of {len(adapters)} ran as batch sizes {sizes}")
    return results


def exercise(m: LoraManager, row: Row, settings: dict) -> list[np.ndarray]:
    """Swaps, a two-adapter request, timed single requests and a mixed batch, where any recompile is an error."""
    ids = [a.id for a in m.adapters()]
    with torch._dynamo.config.patch(error_on_recompile=True):
        swaps = [m.generate(PROMPT, adapter=a, seed=seed, **settings) for seed, a in enumerate(ids)]
        pair = m.generate(PROMPT, adapter=[(ids[0], 0.7), (ids[1], 1.0)], **settings)
        timed = [m.generate(PROMPT, adapter=ids[0], seed=seed, **settings) for seed in range(TIMED)]
        batch = mixed_batch(m, ids[: m.max_batch], settings)
    row.recompiles = m.recompiles
    row.swap_ms_median = m.stats()["swap_ms_median"]
    row.engine_img_s, row.batch_img_s = images_per_s(timed), images_per_s(batch)
    return [r.image for r in [*swaps, pair, *timed, *batch]]


def plain_diffusers(pipe: DiffusionPipeline, lora: Path, generation: dict) -> tuple[float, list[np.ndarray]]:
    """Images/s of plain diffusers with one LoRA loaded by `load_lora_weights`, eager, the engine's settings."""
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    for name in pipe._lora_loadable_modules:  # PEFT's lora_dropout modules start in training mode
        if (component := getattr(pipe, name, None)) is not None:
            component.eval()

    def call(seed: int) -> tuple[float, np.ndarray]:
        gen = torch.Generator("cpu").manual_seed(seed)  # as the engine seeds each request
        t0 = time.perf_counter()
        image = pipe(PROMPT, generator=gen, **generation).images[0]
        return time.perf_counter() - t0, image

    calls = [call(seed) for seed in range(TIMED + 1)]  # the first untimed: the device's first kernels and allocations
    return 1 / statistics.median(s for s, _ in calls[1:]), [image for _, image in calls]


def adapter_file(m: LoraManager, adapter_id: str) -> Path:
    source = Path(m.spec(adapter_id).source)
    return source if source.is_absolute() else m.catalog_root / source


def real_width_case(row: Row, device: str, dtype: torch.dtype, compile: bool, steps: int | None) -> None:
    """The real-width rows (`bench --real-width sdxl`) at the CUDA defaults but for rounds, which fit the limit."""
    from .real_width import run

    cuda = device.startswith("cuda")
    dtype = dtype if cuda else torch.float32
    row.dtype = str(dtype).removeprefix("torch.")
    report = run("sdxl", device, dtype, 128 if cuda else 8, steps or (4 if cuda else 1), 4, 3, compile, None)
    row.compile_s, row.compile_source = report.compile_s, "compiled" if compile else "eager"
    row.recompiles = report.recompiles
    medians = {name: r.median for name, r in report.rows.items()}
    row.engine_img_s = 1e3 / medians["engine, one adapter"]
    row.batch_img_s = 1e3 / medians["engine, ranks 8/4/16/64"]
    row.diffusers_img_s = 1e3 / medians["plain diffusers, one LoRA"]
    row.real_width = {"ms_per_image": medians, "ratios": report.ratios}


def run_case(name: str, device: str, compile: bool, steps: int | None) -> Row:
    """One case, in this process, from a clean compiler state; any failure is caught into the row."""
    row = Row(name)
    try:
        if name not in CASES:
            raise ValueError(f"unknown case {name!r}; known: {', '.join(CASES)}")
        dtype, start = CASES[name]
        row.dtype = str(dtype).removeprefix("torch.")
        if start is None:
            real_width_case(row, device, dtype, compile, steps)
            return row
        # diffusers gives every denoiser's forward one code object: without a reset this case's compile would count
        # against the previous case's graphs (dynamo's recompile limit) instead of starting as in a fresh process
        torch._dynamo.reset()
        with tempfile.TemporaryDirectory() as folder:
            m, fresh = start(device, dtype, compile, Path(folder))
            settings = {"output_type": "np"} | ({"num_inference_steps": steps} if steps else {})
            with m:
                row.compile_s, row.compile_source = m.compile_s, m.compile_source
                images = exercise(m, row, settings)
            lora = adapter_file(m, m.adapters()[0].id)
            row.diffusers_img_s, reference = plain_diffusers(fresh(), lora, {**m.generation_defaults, **settings})
        row.finite = finite(images + reference)
    except Exception as e:  # noqa: BLE001 - reported in the row; the command exits non-zero
        traceback.print_exc()
        row.error = f"{type(e).__name__}: {e}"
    return row


HEAD = ("case", "dtype", "seconds", "compile s", "recompiles", "swap ms", "engine img/s", "batch img/s")
HEAD += ("diffusers img/s", "finite", "ok", "error")


def line(row: Row | None) -> str:
    """One row of the table in fixed columns (the header for None), so rows print as their cases end."""

    def cell(value) -> str:
        return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)

    cells = HEAD
    if row is not None:
        values = (row.case, row.dtype, row.seconds, row.compile_s, row.recompiles, row.swap_ms_median)
        values += (row.engine_img_s, row.batch_img_s, row.diffusers_img_s, row.finite, row.ok)
        cells = (*map(cell, values), row.error.splitlines()[0] if row.error else "-")
    widths = [max(len(h), 9) for h in HEAD]
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()


def child_case(name: str, device: str, compile: bool, steps: int | None, json_path: Path) -> None:
    """`gpu-check --child NAME`: one case in this process, its row written to `json_path`."""
    quiet()
    row = run_case(name, device, compile, steps)
    json_path.write_text(json.dumps({**asdict(row), "device": describe(device)}))


def run_child(name: str, device: str, compile: bool, steps: int | None, timeout_s: float) -> tuple[Row, str]:
    """One case in a fresh process (a clean CUDA context and compiler state), killed with its children past
    `timeout_s`; its output goes straight to this terminal."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "row.json"
        cmd = [sys.executable, "-m", "lora_manager", "gpu-check", "--child", name, "--device", device]
        cmd += ["--json", str(out), *([] if compile else ["--no-compile"]), *(["--steps", str(steps)] if steps else [])]
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, start_new_session=True)
        try:
            child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        seconds = time.perf_counter() - t0
        if out.exists():
            data = json.loads(out.read_text())
            where = data.pop("device")
            row = Row(**data)
        else:
            where = device
            ended = f"timed out after {timeout_s:.0f} s" if child.returncode == -signal.SIGKILL else "no row"
            row = Row(name, error=f"the case's process ended with code {child.returncode}: {ended}")
    row.seconds = seconds
    return row, where


def describe(device: str) -> str:
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return device


def quiet() -> None:
    """Warnings and progress bars this run gives by design (the template's keys missing from a text encoder's
    checkpoint, SDXL's VAE cast to float32 on every call, every load) would bury the rows; failures land in them."""
    for library in (diffusers, transformers):
        library.utils.logging.set_verbosity_error()
        library.utils.logging.disable_progress_bar()


def main(
    cases: list[str],
    device: str,
    compile: bool,
    steps: int | None,
    json_path: Path | None,
    timeout_s: float = CASE_TIMEOUT_S,
) -> bool:
    """Run every case in its own process, print each row as it ends (and rewrite the JSON); whether all passed."""
    print(f"gpu-check on {device}, torch {torch.__version__}, {'compiled' if compile else 'eager'}", flush=True)
    rows: list[Row] = []
    for name in cases:
        row, where = run_child(name, device, compile, steps, timeout_s)
        rows.append(row)
        print(line(None), flush=True)
        print(line(row), flush=True)
        if json_path is not None:
            report = {
                "device": where,
                "torch": torch.__version__,
                "compile": compile,
                "rows": [{**asdict(r), "ok": r.ok} for r in rows],
            }
            json_path.write_text(json.dumps(report, indent=2))
    print("\n" + "\n".join([line(None), *map(line, rows)]), flush=True)
    return all(r.ok for r in rows)
