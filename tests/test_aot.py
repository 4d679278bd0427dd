"""The AOTInductor denoiser: one package, compiled once, serves every adapter of the tiny preset.

The package is built from an engine whose template holds an adapter (so a baked value would show), then bound to
another engine's own template tensors. Every request must equal the eager engine's image within 1 level of 255
while the swaps only write in place, nothing compiles, the package file never changes, and a fresh process serves
from it after loading in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from lora_manager import LoraManager
from lora_manager.hotswap.aot import (
    AotPackageError,
    AotShapeError,
    DenoiserShapes,
    check_capability,
    file_digest,
    load_denoiser,
    open_package,
    package_denoiser,
    read_metadata,
)
from lora_manager.images import levels

pytestmark = [pytest.mark.slow, pytest.mark.compile]

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a red circle on a blue background"
# ranks 5, 16 (conv only), 12, 8 (+ text encoder), 4 (kohya keys), 32; alphas above, below and equal to the rank;
# no adapter; strength changes of a live adapter and revisits after larger ranks (stale padding would show)
SEQUENCE = [
    ("stripes", 1.0),
    ("outline", 1.0),
    ("dots", 1.0),
    ("pixel", 1.0),
    (None, 1.0),
    ("stripes", 0.5),
    ("stripes", 1.3),
    ("frame", 0.8),
    ("checker", 1.0),
    ("outline", 0.7),
    ("pixel", 0.6),
    ("dots", 1.0),
]


def engine(**kwargs) -> LoraManager:
    return LoraManager.from_preset("tiny", compile=False, device="cpu", slots=1, max_batch=1, fuse=False, **kwargs)


def pixels(result) -> np.ndarray:
    return np.asarray(result.image, dtype=np.int16)


def inductor_files() -> set[str]:
    """Every file in this process's inductor cache: a compile (or a C++ probe) would add some."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = cache_dir()
    return {os.path.join(d, f) for d, _, files in os.walk(root) for f in files}


@pytest.fixture(scope="module")
def eager():
    with engine() as m:
        yield m


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """Package once, from an engine that holds `dots` at 0.8: values that a correct package must not keep."""
    with engine() as builder:
        builder.generate(PROMPT, "dots", 0.8, steps=1)
        gen = builder.generation_defaults
        shapes = DenoiserShapes.for_pipeline(
            builder.pipe, gen["height"], gen["width"], images=1, guidance=gen["guidance_scale"] > 1
        )
        path = tmp_path_factory.mktemp("aot") / "tiny_unet.pt2"
        t0 = time.perf_counter()
        package_denoiser(builder.pipe, path, shapes)
        build_s = time.perf_counter() - t0
    size = path.stat().st_size / 2**20
    print(f"\npackage built in {build_s:.1f} s ({size:.1f} MiB, no weights): {shapes.describe()}")
    return SimpleNamespace(path=path, build_s=build_s, shapes=shapes)


def test_an_engine_that_merged_an_adapter_is_refused_before_export(tmp_path):
    """The fused path runs the base layers alone, so an export would trace no LoRA tensor, and a package run over
    merged weights would add the adapter twice: both refused, naming the fix."""
    with LoraManager.from_preset("tiny", compile=False, device="cpu", slots=1, max_batch=1) as fusing:
        fusing.generate(PROMPT, "dots", 0.8, steps=1)
        assert fusing.stats()["fused"]
        gen = fusing.generation_defaults
        shapes = DenoiserShapes.for_pipeline(fusing.pipe, gen["height"], gen["width"], images=1, guidance=True)
        with pytest.raises(ValueError, match="fuse=False"):
            package_denoiser(fusing.pipe, tmp_path / "merged.pt2", shapes)
        with pytest.raises(ValueError, match="fuse=False"):
            load_denoiser(fusing.pipe, tmp_path / "merged.pt2")  # refused before the file is read
    assert not (tmp_path / "merged.pt2").exists()


@pytest.fixture(scope="module")
def served(package):
    """A second engine, never exported, whose UNet runs the package bound to its own template tensors."""
    with engine(aot_package=package.path) as m:
        assert m.compile_source == f"AOTInductor package ({package.path.name})" and "aot_load" in m.startup_s
        print(f"\npackage loaded and bound in {m.aot.load_s * 1e3:.0f} ms ({len(m.aot.bound)} tensors)")
        yield m


def test_the_package_reads_the_templates_own_tensors(served):
    """Zero-copy binding: every tensor a swap writes into the UNet (A, B and scaling of each template module) is,
    by identity, one the package reads; so are the UNet's base weights."""
    bound = {id(t) for t in served.aot.bound.values()}
    modules = served.residency.slots[0].modules.items()
    written = [live for (component, _), live in modules if component == served.denoiser_name]
    assert written and all(id(t) in bound for live in written for t in (live.A, live.B, live.scaling))
    assert all(id(p) in bound for p in served.pipe.unet.parameters())


def test_swaps_match_the_eager_engine_without_compiling(served, eager, package, monkeypatch):
    digest, mtime = file_digest(package.path), package.path.stat().st_mtime_ns
    files = inductor_files()
    graphs, inductor = counters["stats"]["unique_graphs"], dict(counters["inductor"])

    def no_compile(*args, **kwargs):
        raise AssertionError("something compiled while serving from the AOT package")

    import torch._inductor.compile_fx as compile_fx

    for module, name in [
        (torch._inductor, "aoti_compile_and_package"),
        (torch._inductor, "aot_compile"),
        (compile_fx, "compile_fx"),
        (compile_fx, "compile_fx_aot"),
        (torch.export, "export"),
    ]:
        monkeypatch.setattr(module, name, no_compile)

    base = None
    aot_ms, eager_ms, diffs = [], [], []
    for adapter, strength in SEQUENCE:
        calls = served.aot.calls
        got = served.generate(PROMPT, adapter, strength, seed=1)
        want = eager.generate(PROMPT, adapter, strength, seed=1)
        steps = got.info["num_inference_steps"]
        assert served.aot.calls - calls == steps, "the UNet did not run through the package"
        diff = levels(pixels(got), pixels(want))
        assert diff <= 1, f"{adapter} at {strength}: {diff} levels of 255 from the eager engine"
        diffs.append(diff)
        if adapter is None:
            base = pixels(got)
        aot_ms.append(got.info["generate_ms"])
        eager_ms.append(want.info["generate_ms"])
    for adapter in ("stripes", "outline", "dots", "pixel"):  # the comparisons above were not between base images
        assert levels(pixels(served.generate(PROMPT, adapter, seed=1)), base) > 10, adapter

    assert file_digest(package.path) == digest and package.path.stat().st_mtime_ns == mtime
    assert inductor_files() == files, "the inductor cache grew while serving"
    assert counters["stats"]["unique_graphs"] == graphs and dict(counters["inductor"]) == inductor
    print(
        f"\nper image ({steps} steps, batch {package.shapes.batch}): AOT {np.median(aot_ms):.0f} ms, "
        f"eager {np.median(eager_ms):.0f} ms (medians of {len(SEQUENCE)}); levels from eager: {diffs}"
    )


def test_other_shapes_are_refused_not_miscomputed(served):
    pipe = served.pipe
    with pytest.raises(AotShapeError, match="compiled for batch 2"):
        pipe(PROMPT, height=32, width=32, num_inference_steps=1)
    with pytest.raises(AotShapeError, match="compiled for batch 2"):  # no guidance: 1 row instead of 2
        pipe(PROMPT, height=64, width=64, num_inference_steps=1, guidance_scale=1.0)
    with pytest.raises(AotShapeError):
        served.generate(PROMPT, "stripes", steps=1, num_images_per_prompt=2)
    # and the engine still serves afterwards
    assert served.generate(PROMPT, "stripes", steps=1).image.size == (64, 64)


def test_a_package_names_its_cuda_capability_and_another_gpu_is_refused(package):
    """A CUDA package's kernels run only on the compute capability they were compiled for; a CPU package has none."""
    assert read_metadata(open_package(package.path))["cuda_capability"] is None
    check_capability(None, "9.0", "cpu.pt2")
    check_capability("9.0", "9.0", "h100.pt2")
    with pytest.raises(
        AotPackageError,
        match=r"a10\.pt2 was compiled for CUDA compute capability 8\.6; this device "
        r"has 9\.0\. Build a package on this GPU",
    ):
        check_capability("8.6", "9.0", "a10.pt2")
    with pytest.raises(AotPackageError, match="this device has no CUDA"):
        check_capability("8.6", None, "a10.pt2")


CHILD = (
    textwrap.dedent("""
    import json, os, sys, time
    t0 = time.perf_counter()
    import numpy as np, torch
    torch.set_num_threads(2)
    from lora_manager import LoraManager
    from lora_manager.hotswap.aot import load_denoiser
    m = LoraManager.from_preset("tiny", compile=False, device="cpu", slots=1, max_batch=1, fuse=False)
    ready = time.perf_counter()
    aot = load_denoiser(m.pipe, sys.argv[1])
    loaded = time.perf_counter()
    images = {a: np.asarray(m.generate("%s", a, s, seed=2).image) for a, s in [("dots", 0.8), ("pixel", 1.0)]}
    np.savez(sys.argv[2], **images)
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    print(json.dumps({
        "engine_s": ready - t0, "load_s": loaded - ready, "first_image_s": time.perf_counter() - loaded,
        "calls": aot.calls, "cache_files": [f for _, _, fs in os.walk(cache) for f in fs],
        "compile_modules": [n for n in ("torch._inductor.compile_fx", "torch._inductor.codecache") if n in sys.modules],
    }))
""")
    % PROMPT
)


def test_a_fresh_process_serves_from_the_package_without_compiling(package, eager, tmp_path):
    cache = tmp_path / "inductor_cache"
    cache.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
    }
    out = tmp_path / "images.npz"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(package.path), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["calls"] > 0 and report["cache_files"] == [] and report["compile_modules"] == [], report
    images = np.load(out)
    for adapter, strength in [("dots", 0.8), ("pixel", 1.0)]:
        want = pixels(eager.generate(PROMPT, adapter, strength, seed=2))
        assert levels(images[adapter], want) <= 1, adapter
    assert report["load_s"] < package.build_s / 20
    print(
        f"\nfresh process: package loaded and bound in {report['load_s'] * 1e3:.0f} ms (built in "
        f"{package.build_s:.1f} s); engine start {report['engine_s']:.1f} s, "
        f"first image {report['first_image_s']:.2f} s"
    )
