"""Compile artifacts that travel: torch's inductor cache, bundled once per preset and machine kind, so a machine that
has never compiled (a restarted Space, a new laptop) starts a compiled engine without compiling its graphs or kernels.

A bundle is a tar.gz of the inductor cache directory right after one compile and warm-up of the preset's engine
(FX graph and AOTAutograd cache entries, the compiled C++ or Triton kernels), plus `bundle.json` with the key it was
built for. Installing it copies missing files into the running process's cache directory; torch's own cache keys
decide what is reused, so a bundle that does not fit only costs a normal compile, never an error. The key lets the
engine skip bundles that cannot fit and say why.

On the CPU, inductor names each C++ kernel by a hash of its source and of the compiler command line, and that line
holds torch's absolute include and library paths: a kernel built in one virtual environment is another kernel's file
in any other. Installing therefore files each bundled kernel again under the name this process gives its source
(`kernel_key` over this process's `kernel_command`), so a new machine or a Space builds none of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions, get_compiler_version_info, get_cpp_compiler
from torch._inductor.exc import InvalidCxxCompiler
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._inductor.utils import parallel_num_threads

from ..layout import Layout

log = logging.getLogger(__name__)

FOLDER = "compiled"  # inside a preset's folder
MANIFEST = "bundle.json"
# Inductor settings of every compile whose artifacts travel (the bundle build and a start from a bundle): no
# precompiled header. Inductor builds that header (140 MB on the CPU) before it looks a kernel up, even one the bundle
# holds. A cold compile without it takes longer, so a start that has no bundle keeps it.
OPTIONS = {"cpp_cache_precompile_headers": False}
KERNEL = ".main.cpp"  # a CPU kernel's source in inductor's cache, named by its key; its binary is `.main.so`


@dataclass(frozen=True)
class BundleKey:
    """What a compiled graph depends on beyond the model's code: the toolchain, the machine and the template."""

    torch: str
    device: str  # "cpu" or the CUDA device name
    capability: str  # CPU vector ISA (torch's dispatch level) or CUDA compute capability
    toolchain: str  # the C++ compiler's version (CPU kernels are C++; inductor keys them by it) or the CUDA version
    threads: int  # the CPU kernels' thread count (inductor keys its graphs by it: OMP_NUM_THREADS=1 is another key)
    machine: str
    dtype: str
    target_rank: int
    slots: int
    template_modules: int
    generation: str  # the preset's generation defaults and max_batch: sizes and batch rows shape the graphs

    @property
    def slug(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return f"{self.device.replace(' ', '-').lower()}-torch{self.torch}-{digest}"


def bundle_key(
    device: torch.device, dtype: torch.dtype, target_rank: int, layout: Layout, template_modules: int, generation: dict
) -> BundleKey:
    if device.type == "cuda":
        name, capability = torch.cuda.get_device_name(device), ".".join(map(str, torch.cuda.get_device_capability()))
        toolchain = f"cuda {torch.version.cuda}"
    else:
        name, capability = "cpu", torch.backends.cpu.get_cpu_capability()
        try:
            toolchain = get_compiler_version_info(get_cpp_compiler())
        except InvalidCxxCompiler:
            toolchain = ""
    return BundleKey(
        torch=torch.__version__,
        device=name,
        capability=capability,
        toolchain=toolchain,
        # CPU kernels are keyed by their thread count; CUDA kernels do not depend on it
        threads=parallel_num_threads() if device.type == "cpu" else 0,
        machine=platform.machine(),
        dtype=str(dtype).removeprefix("torch."),
        target_rank=target_rank,
        slots=layout.device_slots,
        template_modules=template_modules,
        generation=json.dumps({**generation, "max_batch": layout.max_batch}, sort_keys=True),
    )


def bundle_path(root: Path, key: BundleKey) -> Path:
    return root / FOLDER / f"{key.slug}.tar.gz"


def missing_compiler(device: torch.device) -> str | None:
    """Why torch.compile cannot build kernels here, or None. On the CPU inductor writes C++ kernels (a bundle does not
    spare the compiler: inductor's CPU cache keys include a fingerprint of it); on CUDA Triton builds each kernel's
    launcher with a C compiler, looked up as Triton does (CC, else gcc, else clang)."""
    if device.type == "cuda":
        cc = os.environ.get("CC")
        if cc and not shutil.which(cc):
            return f"Triton builds its CUDA launchers with the C compiler CC names ({cc}), which is not found"
        if not cc and not (shutil.which("gcc") or shutil.which("clang")):
            return "Triton builds its CUDA launchers with a C compiler, and none was found (gcc, clang or CC)"
        return None
    try:
        get_cpp_compiler()
    except InvalidCxxCompiler as e:
        return f"torch.compile on the CPU needs a C++ compiler (g++, or one named by CXX): {e}"
    return None


def install(path: Path, key: BundleKey) -> str | None:
    """Copy the bundle's cache entries into this process's inductor cache, each C++ kernel under the name this process
    gives it; returns why the bundle was skipped, or None."""
    if not path.is_file():
        return f"no bundle for this machine and template ({path.name})"
    with tarfile.open(path) as tar:
        manifest = json.load(tar.extractfile(MANIFEST))
        if manifest != asdict(key):
            different = sorted(k for k, v in asdict(key).items() if manifest.get(k) != v)
            return f"the bundle was built for another {', '.join(different)}"
        target = Path(cache_dir())
        members = [
            m
            for m in tar.getmembers()
            if m.name != MANIFEST and (m.isfile() or m.isdir()) and not (target / m.name).exists()
        ]
        tar.extractall(target, members=members, filter="data")  # "data": no absolute paths, links or devices
    kernels = [Path(m.name) for m in members if m.name.endswith(KERNEL)]  # none in a CUDA bundle
    command = kernel_command(trust_isa=True) if kernels else ""
    for kernel in kernels:
        _refile_kernel(target, kernel, command)
    return None


def _refile_kernel(cache: Path, source: Path, command: str) -> None:
    """Move a bundled kernel (source and binary) to the name this process's inductor looks it up by."""
    name, old = kernel_key((cache / source).read_text(), command), source.name.removesuffix(KERNEL)
    if name == old:
        return
    folder = cache / name[1:3]  # inductor's layout: <cache>/<key[1:3]>/<key>.main.cpp
    folder.mkdir(exist_ok=True)
    for suffix in (KERNEL, ".main.so"):
        moved, new = cache / source.parent / f"{old}{suffix}", folder / f"{name}{suffix}"
        if moved.is_file() and not new.exists():
            moved.rename(new)


def kernel_command(trust_isa: bool = False) -> str:
    """The compiler command line inductor hashes into a CPU kernel's name in this process, under `OPTIONS`: as
    `CppCodeCache.load_async` builds it for `async_compile.cpp_pybinding` (no separate kernel code, no extra flags,
    vector ISA always on for the CPU). It holds torch's include and library paths.

    Picking the vector ISA builds and loads a test program per ISA the CPU lists (once per process).
    `trust_isa` skips those builds: `install` passes it for a bundle built with this CPU capability and compiler
    version, where the same ISAs already built and loaded."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache, pick_vec_isa  # compile machinery: only here

    with inductor_config.patch({**OPTIONS, "cpp.vec_isa_ok": True if trust_isa else inductor_config.cpp.vec_isa_ok}):
        options = CppTorchDeviceOptions(
            compile_only=False,
            min_optimize=False,
            device_type="cpu",
            extra_flags=(),
            use_relative_path=inductor_config.is_fbcode(),
            vec_isa=pick_vec_isa(),
            **CppPythonBindingsCodeCache.cpp_compile_command_flags,
        )
        return CppBuilder(name="o", sources="i", BuildOption=options).get_command_line()


def kernel_key(source: str, command: str) -> str:
    """The name inductor's C++ code cache gives a CPU kernel's source (its Python bindings included) compiled with
    `command`: the hash `CppCodeCache.load_async` writes it under."""
    from torch._inductor.codecache import get_hash

    return get_hash(source.strip(), f"None {command}", "code")


def build(path: Path, key: BundleKey, compiled_cache: Path) -> tuple[Path, int, int]:
    """Pack `compiled_cache` (an inductor cache directory that saw exactly one compile of the engine) as a bundle;
    also returns how many C++ kernels it holds and how many of them `kernel_key` names as this torch did, the ones
    another environment can reuse."""
    kernels, command = sorted(compiled_cache.rglob(f"*{KERNEL}")), kernel_command()
    portable = sum(kernel_key(k.read_text(), command) == k.name.removesuffix(KERNEL) for k in kernels)
    if portable < len(kernels):
        log.warning(
            "%d of %d C++ kernels are not named as kernel_key names them: other environments rebuild them",
            len(kernels) - portable,
            len(kernels),
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / MANIFEST
        manifest.write_text(json.dumps(asdict(key), indent=2, sort_keys=True))
        with tarfile.open(path, "w:gz") as tar:
            tar.add(manifest, MANIFEST)
            for entry in sorted(compiled_cache.iterdir()):
                tar.add(entry, entry.name)
    return path, len(kernels), portable


def built_kernels() -> int:
    """How many C++ kernel binaries this process's inductor cache holds (the engine counts the ones a start built)."""
    return sum(1 for _ in Path(cache_dir()).rglob("*.main.so"))


def cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX graph cache so far in this process."""
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
