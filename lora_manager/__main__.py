"""Command line: `python -m lora_manager {generate,inspect,bench,gpu-check,loadtest,serve,...} ...` (`--help`: all)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .errors import LoraManagerError
from .options import APP_MAX_BATCH, APP_SLOTS, add_layout_options
from .specs import DTYPE_NAMES

DTYPE_HELP = "the pipeline's dtype (env LORA_DTYPE; default: the preset's on CUDA, float32 on the CPU)"
PIPELINES = {"sd": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline", "flux": "FluxPipeline"}


def cmd_generate(args: argparse.Namespace) -> None:
    import statistics

    from .engine import LoraManager

    if args.repeat < 1:
        raise SystemExit(f"--repeat {args.repeat}: generate at least once")
    mix = [_adapter_arg(a, args.strength) for a in args.adapter]
    m = LoraManager.from_preset(
        args.preset,
        compile=args.compile,
        target_rank=args.target_rank,
        slots=max(args.slots, len(mix)),
        max_batch=args.max_batch,
        dtype=args.dtype,
    )
    times = []
    for _ in range(args.repeat):  # the same request again: its generate_ms, a latency sample without the start
        result = m.generate(args.prompt, adapter=mix, strength=args.strength, seed=args.seed, steps=args.steps)
        times.append(result.info["generate_ms"])
    result.image.save(args.out)
    timing = {"generate_ms_median": statistics.median(times), "generate_ms_min": min(times)} if args.repeat > 1 else {}
    print(
        json.dumps(
            {
                **result.info,
                **timing,
                "compile_source": m.compile_source,
                "startup_s": m.startup_s,
                "out": str(args.out),
            },
            indent=2,
        )
    )


def _adapter_arg(text: str, strength: float) -> tuple[str, float]:
    """`id` or `id:strength` (a LoRA combined with others at its own strength)."""
    adapter_id, _, value = text.partition(":")
    try:
        return adapter_id, float(value) if value else strength
    except ValueError:
        raise SystemExit(f"--adapter {text!r}: expected ID or ID:STRENGTH") from None


def cmd_inspect(args: argparse.Namespace) -> None:
    import diffusers

    from .adapters.inspection import summarize
    from .adapters.reader import read_adapter
    from .adapters.sources import resolve

    pipeline_cls = getattr(diffusers, PIPELINES[args.pipeline])
    path = resolve(args.source, args.source, args.weight_name, args.revision)
    components = {name: None for name in pipeline_cls._lora_loadable_modules}
    weights = read_adapter(path, args.source, pipeline_cls, components, torch.float32)
    print(json.dumps({"source": args.source, "file": str(path), **summarize(weights)}, indent=2))


def cmd_compile_cache(args: argparse.Namespace) -> None:
    """Compile the preset's engine once in an empty inductor cache and pack that cache as the preset's bundle."""
    import tempfile

    from .engine import LoraManager
    from .hotswap import compile_cache

    with tempfile.TemporaryDirectory() as fresh:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh  # read by inductor whenever it resolves its cache
        m = LoraManager.from_preset(
            args.preset,
            compile=True,
            slots=args.slots,
            max_batch=args.max_batch,
            compile_kwargs={"options": compile_cache.OPTIONS},
            compile_bundle=False,
        )
        if m.catalog_root is None:
            raise SystemExit(f"compile-cache: preset {args.preset!r} has no folder to keep a bundle in")
        path, kernels, portable = compile_cache.build(
            compile_cache.bundle_path(m.catalog_root, m.compile_key), m.compile_key, Path(fresh)
        )
    print(
        json.dumps(
            {
                "bundle": str(path),
                "mb": round(path.stat().st_size / 2**20, 1),
                "compile_s": round(m.compile_s, 1),
                "key": m.compile_key.slug,
                "cpp_kernels": kernels,
                "cpp_kernels_portable": portable,
            },
            indent=2,
        )
    )


def cmd_aot_package(args: argparse.Namespace) -> None:
    """AOT-compile the preset's denoiser, template in place, into a package whose LoRA tensors stay swappable."""
    import time

    from .engine import LoraManager
    from .hotswap.aot import DenoiserShapes, package_denoiser

    # fuse=False: the package always runs the LoRA branch, so the base weights must stay the base
    with LoraManager.from_preset(args.preset, compile=False, slots=args.slots, fuse=False) as m:
        gen = m.generation_defaults
        shapes = DenoiserShapes.for_pipeline(
            m.pipe, gen.get("height", 512), gen.get("width", 512), guidance=gen.get("guidance_scale", 7.5) > 1
        )
        t0 = time.perf_counter()
        path = package_denoiser(m.pipe, args.out, shapes)
    print(
        json.dumps(
            {
                "package": str(path),
                "mb": round(path.stat().st_size / 2**20, 1),
                "build_s": round(time.perf_counter() - t0, 1),
                "shapes": shapes.describe(),
            },
            indent=2,
        )
    )


def cmd_bench(args: argparse.Namespace) -> None:
    from .bench import bench, real_width

    (real_width.main if args.real_width else bench.main)(args)


def cmd_gpu_check(args: argparse.Namespace) -> None:
    from .bench import gpu_check

    if args.child:
        return gpu_check.child_case(args.child, args.device, not args.no_compile, args.steps, args.json)
    cases = args.cases.split(",")
    if not gpu_check.main(cases, args.device, not args.no_compile, args.steps, args.json, args.case_timeout):
        raise SystemExit(1)


def cmd_loadtest(args: argparse.Namespace) -> None:
    from .bench import loadtest

    loadtest.main(args.clients, args.requests, args.seed, args.json, args.preset, args.max_batch, args.rounds)


def cmd_skewtest(args: argparse.Namespace) -> None:
    from .bench import skewtest

    skewtest.main(
        args.adapters,
        args.zipf,
        args.cache_fraction,
        args.compile,
        args.max_batch,
        args.clients,
        args.requests,
        args.steps,
        args.seed,
        args.json,
        args.preset,
    )


def add_skewtest(sub) -> None:
    """The `skewtest` command's flags (defaults: the README's run)."""
    skew = sub.add_parser("skewtest", help="many adapters, a small CPU cache, Zipf-skewed requests vs one adapter")
    skew.add_argument("--adapters", type=int, default=300, help="LoRAs to write and register (ranks 2-32)")
    skew.add_argument("--zipf", type=float, default=1.1, help="the Zipf exponent s of the adapters' popularity")
    skew.add_argument("--cache-fraction", type=float, default=0.1, help="CPU cache budget, a fraction of their bytes")
    skew.add_argument("--compile", action="store_true", help="torch.compile the denoiser (at start)")
    skew.add_argument("--max-batch", type=int, default=4, help="requests one pipeline call may hold")
    skew.add_argument("--clients", type=int, default=8, help="client threads sending at once")
    skew.add_argument("--requests", type=int, default=240, help="per run, over all clients")
    skew.add_argument("--steps", type=int, default=4, help="denoising steps of every request")
    skew.add_argument("--seed", type=int, default=0)
    skew.add_argument("--preset", default="tiny")
    skew.add_argument("--json", type=Path, default=None)
    skew.set_defaults(func=cmd_skewtest)


def cmd_serve(args: argparse.Namespace) -> None:
    from .serving import ray_app as serve  # needs `pip install "ray[serve]"`

    serve.main(args)


def cmd_startbench(args: argparse.Namespace) -> None:
    from .bench import startbench

    startbench.main(args.rounds, args.preset, args.threads, args.json)


def cmd_servebench(args: argparse.Namespace) -> None:
    from .bench import servebench

    servebench.main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lora_manager", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate one image to a PNG")
    gen.add_argument("--preset", default="tiny", help="preset name or catalog .json path")
    gen.add_argument("--prompt", required=True)
    gen.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="ID[:STRENGTH]",
        help="adapter id from the catalog (default: none); repeat it to combine LoRAs, one slot each",
    )
    gen.add_argument("--strength", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--steps", type=int, default=None)
    gen.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    gen.add_argument("--dtype", choices=DTYPE_NAMES, default=os.environ.get("LORA_DTYPE") or None, help=DTYPE_HELP)
    gen.add_argument("--target-rank", type=int, default=None)
    gen.add_argument(
        "--slots", type=int, default=1, help=f"hotswap slots (at least one per --adapter; the app: {APP_SLOTS})"
    )
    gen.add_argument(
        "--max-batch", type=int, default=1, help=f"requests one pipeline call may hold (the app: {APP_MAX_BATCH})"
    )
    gen.add_argument("--repeat", type=int, default=1, help="generate N times and report the median and min generate_ms")
    gen.add_argument("--out", type=Path, default=Path("out.png"))
    gen.set_defaults(func=cmd_generate)

    ins = sub.add_parser("inspect", help="rank, alpha, targets and format of an adapter file or Hub repo")
    ins.add_argument("source", help="a .safetensors path or a Hub repo id")
    ins.add_argument("--weight-name", default=None)
    ins.add_argument("--revision", default=None)
    ins.add_argument("--pipeline", choices=sorted(PIPELINES), default="sd", help="key layout to convert for")
    ins.set_defaults(func=cmd_inspect)

    cc = sub.add_parser("compile-cache", help="build a preset's compile artifacts for this machine kind (see README)")
    cc.add_argument("--preset", default="tiny")
    add_layout_options(cc)
    cc.set_defaults(func=cmd_compile_cache)

    aot = sub.add_parser("aot-package", help="AOTInductor package of the denoiser with swappable LoRA tensors")
    aot.add_argument("--preset", default="tiny")
    aot.add_argument("--slots", type=int, default=1, help="as the engine that loads it will run (default 1)")
    aot.add_argument("--out", type=Path, required=True, help="the .pt2 file to write")
    aot.set_defaults(func=cmd_aot_package)

    ben = sub.add_parser("bench", help="time every way of switching LoRAs side by side (JSON + plot)")
    ben.add_argument("--scale", choices=("tiny", "sdxl"), default="tiny")
    ben.add_argument("--repeats", type=int, default=10)
    ben.add_argument("--json", type=Path, default=None)
    ben.add_argument("--plot", type=Path, default=None, help="PNG path")
    ben.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    ben.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="default: float32 (tiny), bfloat16 (sdxl)",
    )
    ben.add_argument("--compile", action="store_true", help="also time compile and count recompiles over 10 swaps")
    ben.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ben.add_argument(
        "--real-width",
        choices=("sdxl",),
        default=None,
        help="instead: the engine against plain diffusers (fused and not) with the model's real UNet (see docs)",
    )
    ben.add_argument("--latent", type=int, default=None, help="--real-width: latent size (default 128 CUDA, 16 CPU)")
    ben.add_argument("--steps", type=int, default=None, help="--real-width: steps (default 4 CUDA, 2 CPU)")
    ben.add_argument("--batch", type=int, default=4, help="--real-width: requests per pipeline call")
    ben.add_argument("--rounds", type=int, default=None, help="--real-width: timed rounds (default 5 CUDA, 3 CPU)")
    ben.set_defaults(func=cmd_bench)

    gpc = sub.add_parser(
        "gpu-check",
        help="the engine on CUDA, offline: half precision, no recompiles, swap ms and "
        "images/s vs plain diffusers, on the tiny preset and mini SDXL and Flux",
    )
    gpc.add_argument("--device", default="cuda", help="cpu runs it too, slowly (default: cuda)")
    gpc.add_argument(
        "--cases", default="tiny,sdxl,flux,sdxl-real", help="comma-separated, from: tiny, sdxl, flux, sdxl-real"
    )
    gpc.add_argument("--no-compile", action="store_true", help="run the engine eager (for a quick CPU run)")
    gpc.add_argument("--steps", type=int, default=None, help="denoising steps of every image (default: each case's)")
    gpc.add_argument("--case-timeout", type=float, default=150, help="seconds one case's process may run")
    gpc.add_argument("--json", type=Path, default=None, help="rewritten after every case")
    gpc.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one case, in the process that runs it
    gpc.set_defaults(func=cmd_gpu_check)

    load = sub.add_parser("loadtest", help="K concurrent clients x M requests: engine vs naive vs reload per request")
    load.add_argument("--clients", type=int, default=4)
    load.add_argument("--requests", type=int, default=8, help="per client")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--preset", default="tiny")
    load.add_argument("--json", type=Path, default=None)
    load.add_argument("--max-batch", type=int, default=8, help="requests one pipeline call may hold")
    load.add_argument("--rounds", type=int, default=3, help="the batching servers run in turn this many times")
    load.set_defaults(func=cmd_loadtest)
    add_skewtest(sub)

    srv = sub.add_parser("serve", help="Ray Serve: N replicas behind the OpenAI Images API and POST /generate")
    srv.add_argument("--replicas", type=int, default=2)
    srv.add_argument("--preset", default="tiny")
    srv.add_argument(
        "--routing",
        choices=("affinity", "default"),
        default="affinity",
        help="affinity: each adapter to its home replica; default: Ray Serve's multiplexed routing",
    )
    srv.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    srv.add_argument("--dtype", choices=DTYPE_NAMES, default=os.environ.get("LORA_DTYPE") or None, help=DTYPE_HELP)
    srv.add_argument("--slots", type=int, default=1)
    srv.add_argument(
        "--cpus-per-replica",
        type=float,
        default=None,
        help="CPUs Ray reserves for each replica (default: the machine's CPUs shared evenly)",
    )
    srv.add_argument("--address", default=None, help="Ray cluster address (default: start Ray locally)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--max-queued",
        type=int,
        default=64,
        help="images queued beyond what the replicas run at once; more are refused with 429 and Retry-After",
    )
    srv.set_defaults(func=cmd_serve)

    sbn = sub.add_parser("servebench", help="Ray Serve on a local Ray: default vs affinity routing, a replica killed")
    sbn.add_argument("--preset", default="tiny")
    sbn.add_argument("--replicas", type=int, default=2, help="per app (two apps run side by side)")
    sbn.add_argument("--requests", type=int, default=16)
    sbn.add_argument("--clients", type=int, default=2)
    sbn.add_argument("--seed", type=int, default=0)
    sbn.add_argument("--json", type=Path, default=None)
    sbn.set_defaults(func=cmd_servebench)

    stb = sub.add_parser("startbench", help="app.py ready time on empty torch caches: eager vs compiled, in pairs")
    stb.add_argument("--rounds", type=int, default=3, help="eager/compiled pairs, order swapped every round")
    stb.add_argument("--preset", default="tiny")
    stb.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both (default: unset)")
    stb.add_argument("--json", type=Path, default=None)
    stb.set_defaults(func=cmd_startbench)

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except LoraManagerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
