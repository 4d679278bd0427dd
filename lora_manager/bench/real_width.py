"""`python -m lora_manager bench --real-width sdxl`: the engine against the plain diffusers it replaces, at real width.

The pipeline is SDXL's: its UNet built from SDXL's own config (2.57 G parameters, random weights, nothing
downloaded), with small text encoders of SDXL's hidden sizes and a small VAE, so the denoiser is the whole cost. The
rows, ms per image over batches of `--batch` requests under classifier-free guidance:

- plain diffusers, one LoRA loaded by `load_lora_weights`, and the same LoRA fused (`fuse_lora`), interleaved, each
  called on the main thread and on a worker thread (as a Gradio handler, and the engine's worker, call a pipeline);
- then, on the same pipeline, the engine (`max_batch` = the batch): no adapter; every request for the one adapter;
  requests for four adapters of ranks 8/4/16/64 (the rank-16 one on attention and feed-forward, the others on
  attention); requests for four rank-8 attention adapters. Interleaved, every round; all adapters stay on the device.
  Right after the one-adapter call, while the engine holds that adapter merged into the weights, the same pipeline is
  called directly (`pipeline direct, merged`, eager only): what the engine's queue, batching and worker thread cost.

A row's figure is the median over rounds of its pipeline call's time per image; each round prints as it finishes.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from ..adapters.inspection import ATTENTION
from ..engine import LoraManager
from ..openmp import release_idle_threads
from ..specs import AdapterSpec, Catalog
from ..testing import lora_config, lora_layers
from .bench import _sdxl_unet, _threads
from .mini_pipelines import MAX_TOKENS, TOKENIZER, VOCAB, _ready, _vae

FEED_FORWARD = ("ff.net.0.proj", "ff.net.2")
# (id, rank, alpha, targets): the mixed batch's four adapters, then four of one rank and target for the same-rank mix
MIXED = (("r8", 8, 8.0, ATTENTION), ("r4", 4, 4.0, ATTENTION), ("r16", 16, 16.0, ATTENTION + FEED_FORWARD))
MIXED += (("r64", 64, 32.0, ATTENTION),)
SAME_RANK = tuple((f"s8{c}", 8, 8.0, ATTENTION) for c in "abcd")
ONE = "r64"  # the adapter of the one-adapter rows, plain and engine alike
PROMPT = "a red circle on a blue background"


@dataclass
class Row:
    name: str
    ms_per_image: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.ms_per_image)


@dataclass
class Report:
    model: str
    device: str
    dtype: str
    latent: int
    steps: int
    batch: int
    compiled: bool
    rows: dict[str, Row] = field(default_factory=dict)
    compile_s: float | None = None
    recompiles: int = 0
    ratios: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, ms: float) -> None:
        self.rows.setdefault(name, Row(name)).ms_per_image.append(ms)

    def finish(self) -> None:
        """The ratios the issue's bar is set in: higher is faster for the first row named."""
        m = {k: r.median for k, r in self.rows.items()}
        pairs = {
            "engine one adapter / fused": ("engine, one adapter", "plain diffusers, fused"),
            "engine one adapter / fused, worker thread": (
                "engine, one adapter",
                "plain diffusers, fused, worker thread",
            ),
            "engine one adapter / plain diffusers": ("engine, one adapter", "plain diffusers, one LoRA"),
            "engine one adapter / plain diffusers, worker thread": (
                "engine, one adapter",
                "plain diffusers, one LoRA, worker thread",
            ),
            "engine one adapter / engine no adapter": ("engine, one adapter", "engine, no adapter"),
            "engine one adapter / pipeline direct, merged": ("engine, one adapter", "pipeline direct, merged"),
            "engine mixed ranks / engine one adapter": ("engine, ranks 8/4/16/64", "engine, one adapter"),
            "engine same-rank mix / engine one adapter": ("engine, four rank-8", "engine, one adapter"),
        }
        self.ratios = {k: round(m[b] / m[a], 3) for k, (a, b) in pairs.items() if a in m and b in m}


def real_sdxl(dtype: torch.dtype, device: str) -> StableDiffusionXLPipeline:
    """SDXL with its real UNet (random weights) and text encoders of its hidden sizes (768 and 1280, one layer)."""

    def clip(hidden: int, heads: int, projection: int = 768) -> CLIPTextConfig:
        return CLIPTextConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=hidden,
            num_hidden_layers=2,  # SDXL reads the penultimate hidden state
            num_attention_heads=heads,
            max_position_embeddings=MAX_TOKENS,
            projection_dim=projection,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )

    with torch.random.fork_rng():
        torch.manual_seed(0)
        text_encoder = CLIPTextModel(clip(768, 12))
        text_encoder_2 = CLIPTextModelWithProjection(clip(1280, 20, projection=1280))
        vae = _vae(latent_channels=4)
        unet = _sdxl_unet(torch.device("cpu"), torch.float32, filled=True)
    tokenizer = CLIPTokenizer.from_pretrained(TOKENIZER)
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=EulerDiscreteScheduler(beta_schedule="scaled_linear", timestep_spacing="trailing"),
        add_watermarker=False,
    )
    return _ready(pipe, dtype, device)


def write_adapters(unet: torch.nn.Module, folder: Path) -> dict[str, Path]:
    """Every adapter of the rows as a diffusers SDXL LoRA file (alpha in its metadata)."""
    paths = {}
    for seed, (name, rank, alpha, targets) in enumerate(MIXED + SAME_RANK):
        sd = lora_layers(unet, targets, rank, seed, scale=0.05)
        paths[name] = folder / f"{name}.safetensors"
        StableDiffusionXLPipeline.save_lora_weights(
            str(folder),
            unet_lora_layers=sd,
            weight_name=paths[name].name,
            unet_lora_adapter_metadata=lora_config(sd, rank, alpha),
        )
    return paths


def _settings(latent: int, steps: int) -> dict:
    return {"height": 2 * latent, "width": 2 * latent, "num_inference_steps": steps, "guidance_scale": 5.0}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _plain_ms(pipe, batch: int, settings: dict, device: str) -> float:
    """One plain-diffusers pipeline call of `batch` prompts, in ms per image."""
    generators = [torch.Generator("cpu").manual_seed(i) for i in range(batch)]
    _sync(device)
    t0 = time.perf_counter()
    pipe([PROMPT] * batch, generator=generators, output_type="latent", **settings)
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / batch


def _threaded_ms(worker: ThreadPoolExecutor, pipe, batch: int, settings: dict, device: str) -> float:
    """`_plain_ms` on `worker`'s thread with the CPU's only OpenMP pool, as the engine's worker runs: the main thread
    frees its pool first (as `submit` does), the worker its own after the call (as the idle engine worker does)."""

    def call() -> float:
        try:
            return _plain_ms(pipe, batch, settings, device)
        finally:
            release_idle_threads()

    release_idle_threads()
    return worker.submit(call).result()


def _engine_ms(m: LoraManager, adapters: list[str | None], settings: dict) -> float:
    """One engine call of one request per entry of `adapters`, queued behind a request holding the worker so the
    scheduler takes them as one batch: its pipeline call's time, in ms per image."""
    gate = threading.Event()
    blocker = m.submit(PROMPT, steps=1, callback_on_step_end=lambda *a: (gate.wait(), a[3])[1])
    try:
        futures = [
            m.submit(PROMPT, adapter=a, seed=i, output_type="latent", **settings) for i, a in enumerate(adapters)
        ]
    finally:
        gate.set()
    blocker.result()
    results = [f.result() for f in futures]
    if {r.info["batch_size"] for r in results} != {len(adapters)}:
        raise RuntimeError(f"the {len(adapters)} requests did not run as one batch")
    return results[0].info["generate_ms"] / len(adapters)


def _merged_ms(m: LoraManager, batch: int, settings: dict, device: str) -> float:
    """The engine's pipeline called directly, with the adapter of the engine's last call still merged into its
    weights: the fused model as the engine holds it, without the queue and worker."""
    if not m.stats()["fused"]:
        raise RuntimeError("the one-adapter call did not run merged (fuse=False, or the merge failed)")
    return _plain_ms(m.pipe, batch, settings, device)


def run(
    model: str,
    device: str,
    dtype: torch.dtype,
    latent: int,
    steps: int,
    batch: int,
    rounds: int,
    compile: bool,
    out,
    build: Callable[[torch.dtype, str], StableDiffusionXLPipeline] = real_sdxl,
) -> Report:
    """The rows above, each round printed as it finishes and `out` (a JSON path) rewritten; `build` makes the pipeline
    (SDXL at real width; the tests pass a small one of the same layout)."""
    if model != "sdxl":
        raise SystemExit(f"--real-width {model}: only sdxl is built here")
    settings = _settings(latent, steps)
    call = (batch, settings, device)
    report = Report(model, device, str(dtype).removeprefix("torch."), latent, steps, batch, compile)

    def say(text: str) -> None:
        print(text, flush=True)
        if out is not None:
            Path(out).write_text(json.dumps(asdict(report), indent=2))

    t0 = time.perf_counter()
    pipe = build(dtype, device)
    params = sum(p.numel() for p in pipe.unet.parameters()) / 1e9
    say(f"built SDXL at real width in {time.perf_counter() - t0:.0f} s: {params:.2f} G UNet parameters")
    with tempfile.TemporaryDirectory() as folder:
        paths = write_adapters(pipe.unet, Path(folder))
        pipe.load_lora_weights(str(paths[ONE]), adapter_name="one")
        _plain_ms(pipe, batch, settings, device)  # warm-up
        with ThreadPoolExecutor(1, thread_name_prefix="plain") as worker:
            for r in range(rounds):
                report.add("plain diffusers, one LoRA", _plain_ms(pipe, batch, settings, device))
                report.add("plain diffusers, one LoRA, worker thread", _threaded_ms(worker, pipe, *call))
                pipe.fuse_lora()
                report.add("plain diffusers, fused", _plain_ms(pipe, batch, settings, device))
                report.add("plain diffusers, fused, worker thread", _threaded_ms(worker, pipe, *call))
                pipe.unfuse_lora()
                say(f"round {r + 1}: " + ", ".join(f"{k} {v.ms_per_image[-1]:.0f}" for k, v in report.rows.items()))
        pipe.unload_lora_weights()
        specs = tuple(AdapterSpec(id=name, source=str(path)) for name, path in paths.items())
        catalog = Catalog(
            name="real-width-sdxl", base_model="sdxl (random weights)", adapters=specs, generation=settings
        )
        m = LoraManager(pipe, catalog, compile=compile, max_batch=batch, slots=1, device_slots=len(specs))
        report.compile_s = m.compile_s
        rows = {
            "engine, no adapter": [None] * batch,
            "engine, one adapter": [ONE] * batch,
            "engine, ranks 8/4/16/64": [name for name, *_ in MIXED][:batch],
            "engine, four rank-8": [name for name, *_ in SAME_RANK][:batch],
        }
        for adapters in rows.values():  # warm-up: every adapter onto the device, every path run once
            _engine_ms(m, adapters, settings)
        with torch._dynamo.config.patch(error_on_recompile=compile):
            for r in range(rounds):
                for name, adapters in rows.items():
                    report.add(name, _engine_ms(m, adapters, settings))
                    if name == "engine, one adapter" and not compile:
                        report.add("pipeline direct, merged", _merged_ms(m, batch, settings, device))
                timed = [k for k in report.rows if k in rows or k == "pipeline direct, merged"]
                say(f"round {r + 1}: " + ", ".join(f"{k} {report.rows[k].ms_per_image[-1]:.0f}" for k in timed))
        report.recompiles = m.recompiles
        m.close()
    report.finish()
    say(table(report))
    return report


def table(report: Report) -> str:
    lines = [
        f"SDXL UNet at real width, {report.device}, {report.dtype}, {report.latent}x{report.latent} latents, "
        f"{report.steps} steps, batches of {report.batch}, {'compiled' if report.compiled else 'eager'}: "
        f"median ms per image over {len(next(iter(report.rows.values())).ms_per_image)} rounds",
        "| row | ms per image |",
        "|---|---|",
    ]
    lines += [f"| {r.name} | {r.median:.0f} |" for r in report.rows.values()]
    lines += [f"{k}: {v:.2f}x" for k, v in report.ratios.items()]
    lines.append(
        f"recompiles: {report.recompiles}" + (f", compile {report.compile_s:.0f} s" if report.compile_s else "")
    )
    return "\n".join(lines)


def main(args) -> None:
    """The CLI's `bench --real-width`: CUDA where there is one, float16 there and float32 on the CPU."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    dtype = getattr(torch, args.dtype or ("float16" if cuda else "float32"))
    with _threads(args.threads):
        run(
            args.real_width,
            device,
            dtype,
            args.latent or (128 if cuda else 16),
            args.steps or (4 if cuda else 2),
            args.batch,
            args.rounds or (5 if cuda else 3),
            args.compile,
            args.json,
        )
