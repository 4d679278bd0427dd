"""`python -m lora_manager gpu-check`: what only a GPU shows about the engine, in one offline run.

Half precision on CUDA kernels (float16, bfloat16), compiled graphs that survive swaps, two-adapter requests and mixed
batches without one recompile, swap latency, and throughput against plain diffusers; on the tiny preset and on small
random-weight SDXL and Flux pipelines built from config, so nothing is downloaded. A failing case is shown in its row
of the one table printed at the end, and makes the command exit non-zero.
"""

from __future__ import annotations

import json
import statistics
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
from ..specs import AdapterSpec, Catalog, Result
from ..testing import write_adapter
from .mini_pipelines import FLUX_GEN, SDXL_GEN, mini_flux, mini_sdxl

PROMPT = "a red circle on a blue background"
ENGINE = {"max_batch": 4, "slots": 2}  # as the app runs it
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
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.recompiles == 0 and self.finite is True


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


CASES: dict[str, tuple[torch.dtype, Start]] = {
    "tiny": (torch.float16, start_tiny),
    "sdxl": (torch.float16, mini_case(mini_sdxl, SDXL_GEN)),
    "flux": (torch.bfloat16, mini_case(mini_flux, FLUX_GEN)),
}


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


def run_case(name: str, device: str, compile: bool, steps: int | None) -> Row:
    """One case from a clean compiler state; any failure is caught into the row."""
    row = Row(name)
    try:
        if name not in CASES:
            raise ValueError(f"unknown case {name!r}; known: {', '.join(CASES)}")
        dtype, start = CASES[name]
        row.dtype = str(dtype).removeprefix("torch.")
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


def table(rows: list[Row]) -> str:
    """Aligned columns, an error by its first line (the JSON and the traceback above have the rest)."""
    head = (
        "case",
        "dtype",
        "compile s",
        "recompiles",
        "swap ms",
        "engine img/s",
        "batch img/s",
        "diffusers img/s",
        "finite",
        "ok",
        "error",
    )

    def cell(value) -> str:
        return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)

    lines = [
        [
            cell(v)
            for v in (
                r.case,
                r.dtype,
                r.compile_s,
                r.recompiles,
                r.swap_ms_median,
                r.engine_img_s,
                r.batch_img_s,
                r.diffusers_img_s,
                r.finite,
                r.ok,
                r.error and r.error.splitlines()[0],
            )
        ]
        for r in rows
    ]
    widths = [max(len(x) for x in column) for column in zip(head, *lines, strict=True)]
    return "\n".join(
        "  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip() for line in [head, *lines]
    )


def main(cases: list[str], device: str, compile: bool, steps: int | None, json_path: Path | None) -> bool:
    """Run every case, print the table (and write JSON); whether every case passed."""
    # warnings and progress bars this run gives by design (the template's keys missing from a text encoder's
    # checkpoint, SDXL's VAE cast to float32 on every call, every load) would bury the table; failures land in it
    for library in (diffusers, transformers):
        library.utils.logging.set_verbosity_error()
        library.utils.logging.disable_progress_bar()
    rows = [run_case(name, device, compile, steps) for name in cases]
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    where = f"{device} ({torch.cuda.get_device_name(device)})" if cuda else device
    print(f"gpu-check on {where}, torch {torch.__version__}, {'compiled' if compile else 'eager'}")
    print(table(rows))
    if json_path is not None:
        report = {
            "device": where,
            "torch": torch.__version__,
            "compile": compile,
            "rows": [{**asdict(r), "ok": r.ok} for r in rows],
        }
        json_path.write_text(json.dumps(report, indent=2))
    return all(r.ok for r in rows)
