"""Compile artifacts that travel: a bundle built once lets a process with an empty inductor cache start compiled
without compiling, and a bundle that does not fit costs a normal compile, never an error."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from lora_manager import LoraManager
from lora_manager.errors import LoraManagerError
from lora_manager.hotswap import compile_cache
from lora_manager.layout import Layout

from helpers import PROMPT, ROOT

TINY = ROOT / "lora_manager" / "presets" / "tiny"
SHOWN = (None, "frame", "pixel")  # the adapters each start draws, with seed 3 and 3 steps
SERVE = """
import json, sys, numpy as np
from lora_manager import LoraManager
from lora_manager.layout import Layout
m = LoraManager.from_preset(sys.argv[1], compile=True, slots=2)
images = [np.asarray(m.generate(PROMPT, adapter=a, seed=3, steps=3).image).tolist() for a in SHOWN]
print(json.dumps({"stats": m.stats(), "images": images}))
""".replace("PROMPT", repr(PROMPT)).replace("SHOWN", repr(SHOWN))


def catalog_outside_the_repo(tmp_path) -> str:
    """The tiny preset's catalog with absolute paths, in a folder of its own: its bundle lands there."""
    catalog = json.loads((TINY / "catalog.json").read_text())
    catalog["base_model"] = str(TINY / catalog["base_model"])
    for a in catalog["adapters"]:
        a["source"] = str(TINY / a["source"])
        a["preview"] = None
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(catalog))
    return str(path)


def as_if_built_elsewhere(bundle: Path) -> int:
    """Give every C++ kernel in the bundle another name, as inductor names the same source where torch is installed at
    another path (the name hashes the compiler command line, include paths and all); returns how many it renamed."""
    with tarfile.open(bundle) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    renamed = 0
    with tarfile.open(bundle, "w:gz") as tar:
        for member, data in members:
            key, dot, suffix = member.name.rpartition("/")[2].partition(".")
            if suffix in ("main.cpp", "main.so"):
                digest = hashlib.sha256(f"elsewhere {key}".encode()).digest()
                other = "c" + base64.b32encode(digest).decode().lower()[:51]
                member.name, renamed = f"{other[1:3]}/{other}{dot}{suffix}", renamed + 1
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
    return renamed


def run(*args: str, cache: str, timeout: int = 900) -> str:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.compile
def test_a_bundle_starts_a_fresh_process_compiled_without_compiling(tmp_path):
    catalog = catalog_outside_the_repo(tmp_path)
    built = json.loads(
        run(
            "-m",
            "lora_manager",
            "compile-cache",
            "--preset",
            catalog,
            "--slots",
            "2",
            "--max-batch",
            "1",
            cache=str(tmp_path / "unused"),
        )
    )
    assert (tmp_path / "compiled").is_dir() and built["bundle"].startswith(str(tmp_path / "compiled"))
    assert built["cpp_kernels"] > 0 and built["cpp_kernels_portable"] == built["cpp_kernels"]
    assert as_if_built_elsewhere(Path(built["bundle"])) == 2 * built["cpp_kernels"]
    fresh = json.loads(run("-c", SERVE, catalog, cache=str(tmp_path / "empty-cache")).splitlines()[-1])
    stats = fresh["stats"]
    assert stats["compile_source"].endswith(": no graph compiled"), stats["compile_source"]
    assert stats["recompiles"] == 0 and stats["compile_cache_misses"] == 0 and stats["compile_cache_hits"] > 0
    assert stats["compile_built_kernels"] == 0  # each kernel was filed under this process's name for its source
    with LoraManager.from_preset(catalog, compile=False, slots=2) as eager:  # the reference, in this process
        for adapter, image in zip(SHOWN, fresh["images"], strict=True):
            expected = np.asarray(eager.generate(PROMPT, adapter=adapter, seed=3, steps=3).image, dtype=int)
            assert np.abs(np.asarray(image, dtype=int) - expected).max() <= 1, adapter


def test_a_bundle_for_another_machine_is_skipped_with_the_reason(tmp_path):
    key = compile_cache.bundle_key(torch.device("cpu"), torch.float32, 32, Layout(2, 2), 100, {"height": 64})
    assert "version" in key.toolchain  # the compiler's own version text: another gcc builds other kernels
    assert key.threads == torch.get_num_threads()  # inductor's graph keys hold the kernels' thread count
    other = compile_cache.BundleKey(
        **{**key.__dict__, "torch": "0.0.1", "capability": "AVX9", "toolchain": "cc 1", "threads": key.threads + 1}
    )
    (tmp_path / "empty").mkdir()
    path, kernels, _ = compile_cache.build(tmp_path / "b.tar.gz", other, tmp_path / "empty")
    assert kernels == 0
    assert compile_cache.install(path, key) == "the bundle was built for another capability, threads, toolchain, torch"
    assert "no bundle" in compile_cache.install(tmp_path / "missing.tar.gz", key)
    with tarfile.open(path) as tar:
        assert tar.getnames() == [compile_cache.MANIFEST]


def test_auto_is_eager_on_the_cpu_and_compile_without_a_cpp_compiler_says_why():
    """Inductor on the CPU needs a C++ compiler even for a bundle's cache hits (its keys fingerprint the compiler)."""
    with LoraManager.from_preset("tiny", device="cpu", slots=2, max_batch=4) as m:  # compile=None, the app's engine
        assert not m.compiled and m.stats()["compile_source"] == "eager"
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/g++",)}):
        with pytest.raises(LoraManagerError, match=r"torch.compile on the CPU needs a C\+\+ compiler"):
            LoraManager.from_preset("tiny", compile=True, device="cpu")


def test_on_cuda_a_missing_c_compiler_for_triton_says_why(monkeypatch, tmp_path):
    """Triton builds its CUDA launchers with a C compiler: CC, else gcc, else clang (triton/runtime/build.py)."""
    cuda = torch.device("cuda")
    monkeypatch.setenv("CC", str(tmp_path / "no-cc"))
    assert compile_cache.missing_compiler(cuda) == (
        f"Triton builds its CUDA launchers with the C compiler CC names ({tmp_path / 'no-cc'}), which is not found"
    )
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    assert "none was found (gcc, clang or CC)" in compile_cache.missing_compiler(cuda)
    (tmp_path / "gcc").write_text("#!/bin/sh\n")
    (tmp_path / "gcc").chmod(0o755)
    assert compile_cache.missing_compiler(cuda) is None


@pytest.mark.compile
@pytest.mark.app
def test_startbench_starts_the_app_eager_and_from_the_shipped_bundle_without_compiling(tmp_path):
    """`python -m lora_manager startbench`, the start-up measurement of docs/compile-cache.md: an eager and a
    compiled `app.py`, each on empty torch caches. The tiny preset ships a bundle per CPU kind (AVX512, AVX2), each
    built in another virtual environment than the one running this test (the CI builds its own): every graph and every
    C++ kernel of the compiled start must come from the one that fits this CPU."""
    here = compile_cache.bundle_key(torch.device("cpu"), torch.float32, 0, Layout(), 0, {})
    machine = ("torch", "capability", "toolchain", "machine")
    shipped = {}
    for path in sorted((TINY / compile_cache.FOLDER).glob("*.tar.gz")):
        with tarfile.open(path) as tar:
            shipped[path] = json.load(tar.extractfile(compile_cache.MANIFEST))
    fitting = [(p, m) for p, m in shipped.items() if all(getattr(here, k) == m[k] for k in machine)]
    if not fitting:
        pytest.skip(
            f"no shipped bundle fits this CPU ({here.capability}, {here.machine}, torch {here.torch}, its compiler)"
        )
    [(bundle, built_for)] = fitting
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lora_manager",
            "startbench",
            "--rounds",
            "1",
            "--threads",
            str(built_for["threads"]),
            "--json",
            str(tmp_path / "start.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "start.json").read_text())
    starts = {s["mode"]: s for s in result["starts"]}
    assert starts["eager"]["compile_source"] == "eager" and "compile" not in starts["eager"]["phases"]
    # no ", N C++ kernel(s) built" after it: every kernel was filed under this environment's name for its source
    assert starts["compiled"]["compile_source"] == f"artifacts ({bundle.name}): no graph compiled"
    assert "compile artifacts" in starts["compiled"]["phases"] and "warm up" in starts["compiled"]["phases"]
    assert result["ratios"] == [round(starts["compiled"]["ready_s"] / starts["eager"]["ready_s"], 2)]
    none = subprocess.run(
        [sys.executable, "-m", "lora_manager", "startbench", "--rounds", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert none.returncode != 0 and "--rounds 0: measure at least one pair" in none.stderr
