"""LoraManager: the one object that owns the pipeline and its lock, and wires the parts that serve it: the adapter
registry (adapters/), what the device holds (hotswap/residency.py), the compile lifecycle (hotswap/compiling.py) and
the scheduler that batches requests."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from operator import attrgetter
from pathlib import Path
from typing import Any

import torch

from .adapters.catalog import half_variant, load_preset, model_names, resolve_base_model
from .adapters.inspection import attention_keys
from .adapters.reader import AdapterWeights
from .adapters.registry import TEMPLATE_MARGIN, AdapterRegistry, RegisteredAdapter, Template, local_spec
from .adapters.store import AdapterStore
from .dtypes import dtype_name, resolve_dtype
from .errors import LoraManagerError
from .hotswap import compile_cache
from .hotswap.aot import AotDenoiser, load_denoiser
from .hotswap.compiling import Compilation
from .hotswap.residency import Residency
from .layout import Layout
from .openmp import release_idle_threads
from .quiet import quiet_loads
from .request_schema import Mix, check_request
from .scheduler import Request, Scheduler
from .specs import AdapterInfo, AdapterSpec, Catalog, Result

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 4 * 2**30  # ~20 SDXL rank-64 LoRAs; the live adapter is always kept


def _renamed(old: str, new: str) -> property:
    """A deprecated attribute name that reads `new` (a dotted path) with a warning."""

    def read(self):
        warnings.warn(f"LoraManager.{old} is renamed `{new}`", DeprecationWarning, stacklevel=2)
        return attrgetter(new)(self)

    return property(read)


class LoraManager:
    """Serves a diffusers pipeline with many LoRAs: adapters chosen per request, swapped in place, never recompiled.

    `slots=K` lets one request combine up to K adapters, each at its own strength (K templates, swapped one by one).
    `max_batch=B` > 1 runs up to B queued requests in one pipeline call whatever their adapters: `device_slots`
    adapters (default max(K, B)) stay resident on the device and each row of the batch picks its own
    (`hotswap/batched.py`). With `compile`, one graph, dynamic in the batch dimension, serves every size 1..B; each
    size runs once at start. A compiling engine first installs the preset's compile bundle where one fits (unless
    `compile_bundle=False`; `hotswap/compile_cache.py`). `compile=None` compiles on CUDA only: on the CPU a start from
    the bundle still takes 2-3x an eager one (dynamo traces the denoiser again) for images about 10% faster (README).
    `aot_package` (a `.pt2` from `python -m lora_manager aot-package`) runs the denoiser from an AOTInductor package
    bound to the template's own tensors instead: no compile at start, swaps as usual (`hotswap/aot.py`).
    `zero_gpu=True` builds the engine in a ZeroGPU Space's main process, where CUDA must never be initialized: no
    pinned host memory, eager, one request per pipeline call.
    `fuse=True` runs a call whose rows all use the same adapters at the same strengths (or none) on the base weights
    with those adapters merged in, no LoRA branch (`hotswap/fusion.py`), at the cost of one copy of the merged
    layers' base weights while merged (`stats()["fused_bytes"]`); off with an AOT package and on ZeroGPU.
    """

    def __init__(
        self,
        pipe,
        catalog: Catalog | None = None,
        compile: bool | None = False,
        target_rank: int | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        catalog_root: str | Path | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        max_queue: int = 64,
        max_batch: int = 1,
        slots: int = 1,
        device_slots: int | None = None,
        aot_package: str | Path | None = None,
        compile_bundle: bool = True,
        zero_gpu: bool = False,
        fuse: bool = True,
    ):
        layout, compile = _check_layout(pipe.device, slots, max_batch, device_slots, compile, aot_package, zero_gpu)
        self.startup_s: dict[str, float] = {}  # seconds per start-up phase, in order (from_preset adds the load)
        self.pipe, self._lock, self.layout = pipe, threading.RLock(), layout
        self.catalog = catalog or Catalog(name="custom", base_model=getattr(pipe, "name_or_path", "") or "")
        self.catalog_root = Path(catalog_root) if catalog_root else None  # previews and compile bundles live here
        self.base_model, self.model_name = model_names(self.catalog, self.catalog_root)
        self.generation_defaults = dict(self.catalog.generation)
        self.components = {
            n: getattr(pipe, n) for n in pipe._lora_loadable_modules if getattr(pipe, n, None) is not None
        }
        self.denoiser_name = "transformer" if "transformer" in self.components else "unet"
        self.dtype = self.components[self.denoiser_name].dtype
        # page-locked host memory makes host-to-GPU copies async; ZeroGPU's main process must not touch CUDA at all
        pinned = pipe.device.type == "cuda" and not zero_gpu
        self.store = AdapterStore(cache_bytes, pinned, on_evict=lambda _, w: self.residency.forget(w))
        self.registry = AdapterRegistry(self.store, type(pipe), self.components, self.dtype, self.catalog_root)
        with _timed(self.startup_s, "adapter_reads"):
            staged = self.registry.read_catalog(self.catalog.adapters)
        with _timed(self.startup_s, "template"):
            self._build_template(staged, target_rank, fuse and aot_package is None and not zero_gpu)
            self.scheduler = Scheduler(
                self._run_batch, self.residency.live, layout, max_queue=max_queue, loads=self.registry.loader
            )
            self.registry.loader.on_done = self.scheduler.wake
        fusion = self.residency.fusion
        self.compilation = Compilation(
            pipe,
            self.components[self.denoiser_name],
            self.residency.rows,
            layout,
            self.generation_defaults,
            fusion and fusion.switch,
        )
        self.compiled, self.aot = bool(compile), None
        if compile:
            key = self.compile_key  # once: on the CPU it asks the C++ compiler for its version
            bundle = compile_cache.bundle_path(self.catalog_root, key) if self.catalog_root else None
            self.compilation.compile(key, bundle, compile_bundle, compile_kwargs or {}, self.startup_s)
        elif aot_package is not None:  # the denoiser runs an AOTInductor package bound to the template's tensors
            with _timed(self.startup_s, "aot_load"):
                self.aot: AotDenoiser | None = load_denoiser(pipe, aot_package)
            self.compiled, self.compilation.source = True, f"AOTInductor package ({Path(aot_package).name})"
        release_idle_threads()  # batches run on the scheduler's thread: this one's OpenMP pool would slow them
        _OPEN.add(self)

    def _build_template(
        self,
        staged: dict[str, tuple[RegisteredAdapter, AdapterWeights]],
        target_rank,
        fuse: bool,
    ) -> None:
        """Size the template's rank (the largest catalog adapter's unless given), load it over the union of the
        catalog adapters' modules (the denoiser's attention without any), and admit the catalog adapters it holds."""
        ranks = [w.rank for _, w in staged.values()]
        self.target_rank = target_rank or self.catalog.target_rank or max(ranks, default=8)
        keys = set().union(*(reg.keys for reg, w in staged.values() if w.rank <= self.target_rank))
        keys = keys or attention_keys(self.components[self.denoiser_name], self.denoiser_name)
        args = (self.target_rank, self.layout, self.registry, fuse)
        self.residency = Residency(self.pipe, self.components, keys, *args)
        self.registry.template = Template(self.residency.template_keys, self.target_rank)
        self.registry.admit_catalog(staged)

    def close(self) -> None:
        """Stop the scheduler's worker (queued requests fail with EngineClosedError); the pipeline stays usable."""
        self.scheduler.close()
        _OPEN.discard(self)

    def __enter__(self) -> LoraManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def from_preset(
        cls,
        name: str = "tiny",
        compile: bool | None = None,
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
        **kwargs,
    ) -> LoraManager:
        """Load a preset (or a catalog .json path): its base pipeline and adapters.

        Args:
            name: `tiny`, `sd15`, `sdxl`, `flux` or a catalog .json path.
            compile: torch.compile the denoiser; None compiles on CUDA only (see the class docstring).
            device: where the pipeline runs; None is "cuda" where CUDA is available, else "cpu".
            dtype: a `torch.dtype` or its name ("float16", "bfloat16", "float32"); None is the catalog's dtype on a
                CUDA device (`"cuda"`, `"cuda:1"`) and float32 on the CPU. In float16 (bfloat16) the base model's
                "fp16" ("bf16") weight files are loaded where it has them (`variant=`), half the bytes of float32.
        """
        t0 = time.perf_counter()
        pipe, catalog, root = load_pipeline(name, device, dtype)
        loaded = time.perf_counter() - t0
        manager = cls(pipe, catalog, compile=compile, catalog_root=root, **kwargs)
        manager.startup_s = {"pipeline_load": loaded, **manager.startup_s}
        return manager

    # ---- adapters -------------------------------------------------------------------------------------------------

    def register(
        self,
        adapter_id: str,
        source: str,
        weight_name: str | None = None,
        revision: str | None = None,
        allow_local: bool = True,
        max_bytes: int | None = None,
        **spec_fields,
    ) -> AdapterInfo:
        """Fetch, read and check an adapter against the prepared template, then keep it in the CPU cache.

        Args:
            adapter_id: the id requests name it by.
            source: a Hub repo id or a local .safetensors path, relative to the working directory (`allow_local=False`
                refuses paths).
            weight_name, revision: the file in the repo, and the revision to pin.
            max_bytes: refuse a larger file; a Hub file from its declared size, before any byte is downloaded
                (`adapter_byte_limit()` is what the template can hold). What a refused Hub file downloaded is
                removed from the Hub cache again, unless it was cached before.
        """
        spec = local_spec(adapter_id, source, allow_local, weight_name=weight_name, revision=revision, **spec_fields)
        self.registry.register(spec, allow_local, max_bytes, self._lock)
        release_idle_threads()  # the read ran torch here, in the caller's thread
        return self.info(adapter_id)

    def unregister(self, adapter_id: str) -> None:
        """Forget an adapter: no request can name it any more, its CPU-cache entry goes (once it is not live), and
        the Hub cache files its registration downloaded are deleted unless another adapter reads the same file."""
        with self._lock:
            self.registry.unregister(adapter_id, self.residency.live())

    def adapter_byte_limit(self, cap_bytes: int | None = None) -> int:
        """The largest adapter file worth fetching: what the template could hold (rank `target_rank` on every module
        of its union, text encoder included, 4 bytes a value), with room for the file's header and alphas, or
        `cap_bytes` if smaller."""
        limit = int(self.residency.values_per_adapter() * 4 * TEMPLATE_MARGIN) + 2**20
        return min(limit, cap_bytes) if cap_bytes is not None else limit

    def adapters(self) -> list[AdapterInfo]:
        with self._lock:
            live = self.residency.live()
            return [self.registry.info(i, live) for i in self.registry.ids()]

    def info(self, adapter_id: str) -> AdapterInfo:
        with self._lock:
            return self.registry.info(adapter_id, self.residency.live())

    def spec(self, adapter_id: str) -> AdapterSpec:
        return self.registry.require(adapter_id).spec

    @property
    def refused(self) -> dict[str, str]:
        """Catalog adapters refused at start-up, with their reason."""
        return self.registry.refused

    def asset_path(self, relative: str | None) -> Path | None:
        """A catalog file (e.g. a preview image) resolved against the catalog's folder; None if absent."""
        if not relative or self.catalog_root is None:
            return None
        path = self.catalog_root / relative
        return path if path.is_file() else None

    # ---- generation -----------------------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str,
        adapter: str | list | None = None,
        strength: float = 1.0,
        seed: int = 0,
        steps: int | None = None,
        **pipe_kwargs,
    ) -> Result:
        """Generate one image with `adapter` (an id, None, or up to `slots` ids or (id, strength) pairs) at
        `strength`. Safe from many threads: requests queue in the scheduler, which swaps only between generations
        and groups requests by adapter (with `max_batch` > 1, runs up to that many in one batch, mixed adapters)."""
        return self.submit(prompt, adapter, strength, seed, steps, **pipe_kwargs).result()

    def submit(
        self,
        prompt: str,
        adapter: str | list | None = None,
        strength: float = 1.0,
        seed: int = 0,
        steps: int | None = None,
        **pipe_kwargs,
    ) -> Future:
        """Queue a request and return a Future of its Result; raises QueueFullError when the queue is full."""
        release_idle_threads()  # a client thread that ran torch work keeps OpenMP threads that slow the batches
        req = check_request(prompt, adapter, strength, seed, steps, self.max_adapters)
        for adapter_id, _ in req.adapters:
            self.registry.require(adapter_id)
            self.store.record(adapter_id)  # what the CPU cache keeps follows how often each adapter is asked for
        params = {**self.generation_defaults, **pipe_kwargs}
        if req.steps is not None:
            params["num_inference_steps"] = req.steps
        return self.scheduler.submit(Request(req.prompt, req.adapters, req.seed, params))

    def _run_batch(self, requests: list[Request]) -> list[Result | BaseException]:
        """Run queued requests as one pipeline call (the scheduler's worker calls this, one batch at a time): their
        adapters become resident (`Residency.make_resident`), and an adapter refused on its way in fails only the
        requests that named it."""
        with self._lock:
            upcoming = self.scheduler.upcoming()
            batch = {a for r in requests for a in r.adapter_ids}
            self.store.protected = frozenset(upcoming) | batch  # the queued stay cached
            swap = self.residency.make_resident([r.adapters for r in requests])
            runnable = [r for r in requests if swap.runs(r.adapter_ids)]
            images, generate_ms = self._call(runnable, upcoming) if runnable else ([], 0.0)
            recompiles = self.recompiles
        shared = {k: v for k, v in requests[0].params.items() if isinstance(v, (int, float, str, bool, type(None)))}
        run = {"swap_ms": swap.ms, "generate_ms": generate_ms, "batch_size": len(runnable)}
        run |= {"compiled": self.compiled, "dtype": self.dtype_name, "recompiles": recompiles}
        images = iter(images)
        return [
            self._result(r, next(images), shared | run) if swap.runs(r.adapter_ids) else swap.error(r.adapter_ids)
            for r in requests
        ]

    def _result(self, request: Request, image, run: dict[str, Any]) -> Result:
        info = {**_describe(request.adapters), "seed": request.seed, "prompt": request.prompt}
        info["prompt_truncated"] = _truncated(self.pipe, request.prompt)
        return Result(image=image, info={**info, **run, "base_model": self.model_name})

    def _call(self, requests: list[Request], upcoming: list[str]) -> tuple[list, float]:
        """One pipeline call for `requests` (same params), the adapters of the requests still queued (`upcoming`)
        staged meanwhile. Counts graphs compiled during the call as recompiles."""
        prompts = [r.prompt for r in requests]
        generators = [torch.Generator("cpu").manual_seed(r.seed) for r in requests]
        single = len(requests) == 1  # plain diffusers' own call shape, so `info` reproduces it exactly
        self.residency.stage(upcoming)
        t0 = time.perf_counter()
        prompt, generator = (prompts[0], generators[0]) if single else (prompts, generators)
        with self.compilation.counting():
            images = self.pipe(prompt, generator=generator, **requests[0].params).images
        return images, (time.perf_counter() - t0) * 1e3

    def stats(self) -> dict[str, Any]:
        with self._lock:
            engine = {"compiled": self.compiled, "dtype": self.dtype_name, "target_rank": self.target_rank}
            engine["max_batch"] = self.max_batch
            parts = (self.residency, self.compilation, self.store, self.registry.loader, self.scheduler)
            return engine | {k: v for part in parts for k, v in part.report().items()}

    @property
    def recompiles(self) -> int:
        """Graphs compiled during this engine's generations after its warm-up compile."""
        return self.compilation.recompiles

    @property
    def compile_s(self) -> float | None:
        """Seconds the warm-up generations took, compiling included (None: not compiled at start)."""
        return self.compilation.compile_s

    @property
    def compile_source(self) -> str:
        """ "eager", or where the compiled graphs came from."""
        return self.compilation.source

    @property
    def compile_key(self) -> compile_cache.BundleKey:
        """What this engine's compiled graphs depend on beyond the code: which compile bundle fits it."""
        modules = len(self.registry.template.keys)
        args = (self.target_rank, self.layout, modules, self.generation_defaults)
        return compile_cache.bundle_key(self.pipe.device, self.dtype, *args)

    @property
    def dtype_name(self) -> str:
        """The pipeline's dtype as users write it ("float16")."""
        return dtype_name(self.dtype)

    @property
    def max_batch(self) -> int:
        """How many queued requests one pipeline call runs."""
        return self.layout.max_batch

    @property
    def max_adapters(self) -> int:
        """How many adapters one request may combine: the hotswap slots."""
        return len(self.residency.mix_slots)

    # deprecated names, kept for one release
    errors = _renamed("errors", "refused")
    slots = _renamed("slots", "residency.mix_slots")
    device_slots = _renamed("device_slots", "residency.slots")


def load_pipeline(
    name: str, device: str | None = None, dtype: torch.dtype | str | None = None
) -> tuple[Any, Catalog, Path]:
    """A preset's (or catalog file's) base pipeline on `device` in `dtype` (see `LoraManager.from_preset`), with the
    catalog and its folder."""
    from diffusers import DiffusionPipeline

    catalog, root = load_preset(name)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(dtype, catalog.torch_dtype, device)
    base_model = resolve_base_model(catalog, root)
    variant = half_variant(base_model, str(dtype))
    with quiet_loads():
        pipe = DiffusionPipeline.from_pretrained(base_model, dtype=dtype, variant=variant).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe, catalog, root


def _check_layout(
    device: torch.device, slots: int, max_batch: int, device_slots: int | None, compile, aot_package, zero_gpu: bool
) -> tuple[Layout, bool]:
    """Check the engine's layout arguments together; returns the layout and whether to compile (`compile=None`: on
    CUDA only; see the class docstring for why not on the CPU)."""
    layout = Layout.of(slots, max_batch, device_slots)
    if zero_gpu and (layout.mixed or compile):
        raise ValueError(
            f"On ZeroGPU the engine runs eager with max_batch=1 (got compile={compile}, max_batch="
            f"{max_batch}): torch.compile is unavailable there, and the move to the GPU worker splits "
            "the stacked tensors that mixed batches share."
        )
    if aot_package is not None and (compile or layout.mixed):
        raise ValueError(
            "aot_package replaces torch.compile and serves one request per pipeline call: pass "
            "compile=False and max_batch=1."
        )
    if compile is None:
        compile = aot_package is None and device.type == "cuda" and not zero_gpu
    if compile and (no_compiler := compile_cache.missing_compiler(device)):
        raise LoraManagerError(f"{no_compiler}. Install one, or run eager (compile=False, app: --no-compile).")
    return layout, bool(compile)


_OPEN: weakref.WeakSet[LoraManager] = weakref.WeakSet()
_HELD: list[LoraManager] = []


def _before_fork() -> None:
    """Fork only between generations and swaps, so a forked child (ZeroGPU's GPU worker) never starts from a
    half-written template; the child gets fresh locks, and its scheduler restarts (see `Scheduler`)."""
    _HELD[:] = list(_OPEN)
    for engine in _HELD:
        engine._lock.acquire()


def _after_fork_in_parent() -> None:
    for engine in _HELD:
        engine._lock.release()
    _HELD.clear()


def _after_fork_in_child() -> None:
    for engine in _HELD:
        engine._lock = threading.RLock()
    _HELD.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def _describe(mix: Mix) -> dict[str, Any]:
    """`adapter`/`strength` for the info dict: an id and a number for one adapter (None for none), lists for a mix."""
    if len(mix) <= 1:
        return {"adapter": mix[0][0] if mix else None, "strength": mix[0][1] if mix else None}
    return {"adapter": [i for i, _ in mix], "strength": [s for _, s in mix]}


@contextmanager
def _timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Time one start-up step into `phases`."""
    t0 = time.perf_counter()
    yield
    phases[name] = time.perf_counter() - t0


def _truncated(pipe, prompt: str) -> bool:
    """Whether the tokenizer cuts the prompt (CLIP keeps 77 tokens; the tiny model 12): the user is told."""
    tokenizer = getattr(pipe, "tokenizer", None)
    return tokenizer is not None and len(tokenizer(prompt).input_ids) > tokenizer.model_max_length
