"""Compile artifacts that travel: torch's inductor cache, bundled once per preset and machine kind, so a machine that
has never compiled (a restarted Space, a new laptop) starts a compiled engine without compiling its graphs. On the
CPU inductor still rebuilds its C++ kernels where torch is installed at another path than where the bundle was built
(their cache keys hold the compiler command line, include paths and all).

A bundle is a tar.gz of the inductor cache directory right after one compile and warm-up of the preset's engine
(FX graph and AOTAutograd cache entries, the compiled C++ or Triton kernels), plus `bundle.json` with the key it was
built for. Installing it copies missing files into the running process's cache directory; torch's own cache keys
decide what is reused, so a bundle that does not fit only costs a normal compile, never an error. The key lets the
engine skip bundles that cannot fit and say why.
"""

from __future__ import annotations

import hashlib
import json
import platform
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler
from torch._inductor.exc import InvalidCxxCompiler
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._inductor.utils import parallel_num_threads

FOLDER = "compiled"  # inside a preset's folder
MANIFEST = "bundle.json"


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


def bundle_key(device: torch.device, dtype: torch.dtype, target_rank: int, slots: int, template_modules: int,
               generation: dict) -> BundleKey:
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
        torch=torch.__version__, device=name, capability=capability, toolchain=toolchain,
        threads=parallel_num_threads(), machine=platform.machine(),
        dtype=str(dtype).removeprefix("torch."), target_rank=target_rank, slots=slots,
        template_modules=template_modules, generation=json.dumps(generation, sort_keys=True),
    )


def bundle_path(root: Path, key: BundleKey) -> Path:
    return root / FOLDER / f"{key.slug}.tar.gz"


def missing_compiler(device: torch.device) -> str | None:
    """Why inductor cannot run on this CPU (no working C++ compiler), or None. A bundle does not spare the compiler:
    inductor's CPU cache keys include a fingerprint of it."""
    if device.type != "cpu":
        return None
    try:
        get_cpp_compiler()
    except InvalidCxxCompiler as e:
        return str(e)
    return None


def install(path: Path, key: BundleKey) -> str | None:
    """Copy the bundle's cache entries into this process's inductor cache; returns why it was skipped, or None."""
    if not path.is_file():
        return f"no bundle for this machine and template ({path.name})"
    with tarfile.open(path) as tar:
        manifest = json.load(tar.extractfile(MANIFEST))
        if manifest != asdict(key):
            different = sorted(k for k, v in asdict(key).items() if manifest.get(k) != v)
            return f"the bundle was built for another {', '.join(different)}"
        target = Path(cache_dir())
        members = [m for m in tar.getmembers()
                   if m.name != MANIFEST and (m.isfile() or m.isdir()) and not (target / m.name).exists()]
        tar.extractall(target, members=members, filter="data")  # "data": no absolute paths, links or devices
    return None


def build(path: Path, key: BundleKey, compiled_cache: Path) -> Path:
    """Pack `compiled_cache` (an inductor cache directory that saw exactly one compile of the engine) as a bundle."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / MANIFEST
        manifest.write_text(json.dumps(asdict(key), indent=2, sort_keys=True))
        with tarfile.open(path, "w:gz") as tar:
            tar.add(manifest, MANIFEST)
            for entry in sorted(compiled_cache.iterdir()):
                tar.add(entry, entry.name)
    return path


def cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX graph cache so far in this process."""
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
