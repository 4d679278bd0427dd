"""The Space's command line: flags and their environment fallbacks, the preset it runs, the engine, the launch."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import psutil
from fastapi.exceptions import RequestValidationError
from starlette.middleware import Middleware

import lora_manager
from lora_manager import LoraManager, LoraManagerError
from lora_manager.options import add_layout_options
from lora_manager.serving.additions import Additions
from lora_manager.serving.protocol import Engine
from lora_manager.serving.remote import RemoteManager
from lora_manager.space.layout import CSS, build_demo
from lora_manager.space.refusals import RefusalStatus, refused_body
from lora_manager.space.views import phases_text
from lora_manager.space.zerogpu import ZERO_GPU, ZERO_GPU_NOTE
from lora_manager.specs import DTYPE_NAMES

STARTED = psutil.Process().create_time()  # "ready in" counts from the process start, the imports included
PRESETS = Path(lora_manager.__file__).parent / "presets"
README = (
    Path(lora_manager.__file__).resolve().parents[1] / "README.md"
)  # the Space's: its front matter names the hardware
GPU_PRESETS = ("sd15", "sdxl", "flux")  # the order a GPU default is picked in: flux, gated, last
MAX_UPLOAD = "1kb"  # the app has no file input: Gradio's upload route gets nothing bigger than this


def _env_bool(name: str) -> bool | None:
    value = os.environ.get(name, "").strip().lower()
    return None if value in ("", "auto") else value in ("1", "true", "yes", "on")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Gradio Space for lora_manager: one pipeline, many LoRAs chosen per request."
    )
    _model_args(p)
    _visitor_args(p)
    p.add_argument(
        "--backend",
        choices=("local", "ray"),
        default=os.environ.get("LORA_BACKEND", "local"),
        help="local: the engine in this process; ray: a `python -m lora_manager serve` deployment",
    )
    p.add_argument(
        "--ray-url",
        default=os.environ.get("LORA_RAY_URL", "http://127.0.0.1:8000"),
        help="the Ray Serve deployment's HTTP address (with --backend ray)",
    )
    p.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    p.add_argument("--share", action="store_true")
    return p.parse_args(argv)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default=os.environ.get("LORA_PRESET") or None,
        help="tiny, sd15, sdxl, flux or a catalog .json path (env LORA_PRESET; default: with CUDA the preset for the "
        "README's suggested_hardware, else tiny)",
    )
    p.add_argument(
        "--dtype",
        default=os.environ.get("LORA_DTYPE") or None,
        choices=DTYPE_NAMES,
        help="the pipeline's dtype (env LORA_DTYPE; default: the preset's on CUDA, float32 on the CPU)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("LORA_COMPILE"),
        help="torch.compile the denoiser (env LORA_COMPILE; default on for CUDA, never on ZeroGPU)",
    )
    p.add_argument(
        "--aot-package",
        default=os.environ.get("LORA_AOT_PACKAGE") or None,
        help="run the denoiser from this AOTInductor package (`python -m lora_manager aot-package`) "
        "instead of compiling; needs --max-batch 1 --slots 1 (env LORA_AOT_PACKAGE)",
    )
    p.add_argument("--target-rank", type=int, default=None, help="hotswap template rank (default: largest in catalog)")
    p.add_argument("--cache-mb", type=int, default=None, help="CPU adapter cache budget in MiB (default 4096)")
    add_layout_options(p)


def _visitor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-adapter-mb",
        type=int,
        default=_env_int("LORA_MAX_ADAPTER_MB"),
        help="largest LoRA file a visitor may add, MiB (env LORA_MAX_ADAPTER_MB; default: what the template can hold)",
    )
    p.add_argument(
        "--additions-per-visitor",
        type=int,
        default=_env_int("LORA_ADDITIONS_PER_VISITOR") or 4,
        help="LoRAs one visitor may add (env LORA_ADDITIONS_PER_VISITOR; default 4)",
    )
    p.add_argument(
        "--max-additions",
        type=int,
        default=_env_int("LORA_MAX_ADDITIONS") or 16,
        help="visitors' additions kept in all; the least recently used go first (env LORA_MAX_ADDITIONS)",
    )
    p.add_argument(
        "--additions-mb",
        type=int,
        default=_env_int("LORA_ADDITIONS_MB") or 2048,
        help="MiB all visitors' additions may hold, in memory and on disk (env LORA_ADDITIONS_MB)",
    )
    p.add_argument(
        "--shared-additions",
        action=argparse.BooleanOptionalAction,
        default=bool(_env_bool("LORA_SHARED_ADDITIONS")),
        help="every visitor sees every addition (env LORA_SHARED_ADDITIONS=1; default: per visitor)",
    )


@dataclass(frozen=True)
class PresetChoice:
    """The preset the app runs and why, for the ready line."""

    preset: str
    reason: str


def choose_preset(
    requested: str | None, cuda_available: bool, hardware: str | None, preset_hardware: dict[str, str | None]
) -> PresetChoice:
    """The preset asked for; else, with CUDA, the first preset built for `hardware` (the Space's suggested hardware;
    `preset_hardware` in order of preference); else the embedded tiny model, which needs no GPU and no network."""
    if requested:
        return PresetChoice(requested, "asked for")
    if not cuda_available:
        return PresetChoice("tiny", "no CUDA device; LORA_PRESET picks another")
    for preset, built_for in preset_hardware.items():
        if hardware and built_for == hardware:
            return PresetChoice(preset, f"CUDA on {hardware}, the README's suggested_hardware")
    return PresetChoice("tiny", f"no preset is built for {hardware or 'unnamed hardware'}; LORA_PRESET picks one")


def suggested_hardware(readme: Path) -> str | None:
    """`suggested_hardware` from the README's front matter (the Space's configuration), None without one."""
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    front = text.split("\n---", 1)[0] if text.startswith("---") else ""
    found = re.search(r"^suggested_hardware:\s*(\S+)", front, re.MULTILINE)
    return found.group(1) if found else None


def preset_hardware() -> dict[str, str | None]:
    """The hardware each built-in GPU preset's catalog is sized for, in GPU_PRESETS' order."""
    return {name: json.loads((PRESETS / name / "catalog.json").read_text()).get("hardware") for name in GPU_PRESETS}


def default_preset(requested: str | None) -> PresetChoice:
    # ZeroGPU's `spaces` reports CUDA in this process, which has no device until a GPU function runs: tiny there
    import torch  # here, not above: imported before lora_manager, torch made the compiled start miss its bundle

    cuda = torch.cuda.is_available() and not ZERO_GPU
    return choose_preset(requested, cuda, suggested_hardware(README), preset_hardware())


def start_engine(args: argparse.Namespace, preset: str) -> Engine:
    """The engine the flags ask for: in this process (eager on ZeroGPU and with an AOT package) or on Ray Serve."""
    kwargs = {
        "target_rank": args.target_rank,
        "slots": args.slots,
        "max_batch": args.max_batch,
        "aot_package": args.aot_package,
        "dtype": args.dtype,
    }
    if args.cache_mb is not None:
        kwargs["cache_bytes"] = args.cache_mb * 2**20
    compile_ = False if ZERO_GPU or args.aot_package else args.compile
    if ZERO_GPU:
        kwargs.update(max_batch=1, zero_gpu=True)
        print(f"ZeroGPU: {ZERO_GPU_NOTE}", flush=True)
    try:
        if args.backend == "ray":
            return RemoteManager(args.ray_url, preset)
        return LoraManager.from_preset(preset, compile=compile_, **kwargs)
    except (ValueError, LoraManagerError) as e:  # unknown preset, bad catalog: one line, no traceback
        raise SystemExit(f"app.py: {e}") from e


def launch(demo: gr.Blocks, manager: Engine, args: argparse.Namespace) -> None:
    """Queue and serve `demo` (an MCP server too), the previews readable and uploads refused; returns at once."""
    demo.queue(default_concurrency_limit=1, max_size=64)
    previews = {str(p.parent) for a in manager.adapters() if (p := manager.asset_path(a.spec.preview))}
    none = manager.asset_path("previews/none.png")
    demo.launch(
        server_name=args.host,
        server_port=args.port,
        share=args.share,
        prevent_thread_lock=True,
        css=CSS,
        allowed_paths=sorted(previews | ({str(none.parent)} if none else set())),
        max_file_size=MAX_UPLOAD,
        show_error=True,
        mcp_server=True,
        app_kwargs={
            "middleware": [Middleware(RefusalStatus)],
            "exception_handlers": {RequestValidationError: refused_body},
        },
    )


def main(argv: list[str] | None = None) -> None:
    imports_s = time.time() - STARTED
    args = parse_args(argv)
    choice = default_preset(args.preset)
    manager = start_engine(args, choice.preset)
    manager.startup_s = {"imports": imports_s, **manager.startup_s}
    launch_t0 = time.time()
    for adapter_id, reason in manager.refused.items():
        print(f"skipped adapter {adapter_id}: {reason}", flush=True)
    additions = Additions(
        per_session=args.additions_per_visitor,
        max_count=args.max_additions,
        max_bytes=args.additions_mb * 2**20,
        shared=args.shared_additions,
    )
    cap = args.max_adapter_mb * 2**20 if args.max_adapter_mb is not None else None
    demo = build_demo(manager, additions, cap)
    launch(demo, manager, args)
    manager.startup_s["ui_launch"] = time.time() - launch_t0
    print(
        f"ready in {time.time() - STARTED:.1f} s at {demo.local_url} (preset {choice.preset}, "
        f"compiled: {manager.compile_source}, {len(manager.adapters())} adapters; {phases_text(manager.startup_s)}; "
        f"preset: {choice.reason})",
        flush=True,
    )
    demo.block_thread()
