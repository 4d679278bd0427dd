"""LoraManager: the one object that owns the pipeline, the hotswap template, the CPU cache and the lock."""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from .adapters.catalog import load_preset, resolve_base_model
from .adapters.inspection import ATTENTION
from .adapters.reader import AdapterWeights, read_adapter
from .adapters.sources import hub_cache_files, is_local_source, remove_files, resolve
from .adapters.store import AdapterStore
from .adapters.validate import check_adapter
from .errors import LoraManagerError, UnknownAdapterError
from .hotswap import compile_cache
from .hotswap.aot import AotDenoiser, load_denoiser
from .hotswap.batched import BatchRows
from .hotswap.plan import assign_slots, plan_resident
from .hotswap.slot import DevicePrefetch, LiveSlot, sync
from .hotswap.template import BATCH_DIM, compile_denoiser, prepare_template
from .quiet import quiet_loads
from .request_schema import Mix, check_request, shorten
from .scheduler import Request, Scheduler
from .specs import DTYPE_NAMES, AdapterInfo, AdapterSpec, Catalog, Result

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 4 * 2**30  # ~20 SDXL rank-64 LoRAs; the live adapter is always kept
TEMPLATE_MARGIN = 1.25  # a file's header, alpha tensors and fp32 padding on top of its template-sized tensors


@dataclass(frozen=True)
class _Registered:
    """A registered adapter: its catalog entry and what its file says (kept even when evicted from RAM)."""

    spec: AdapterSpec
    keys: frozenset[tuple[str, str]]
    rank: int
    alpha: float
    nbytes: int
    has_text_encoder: bool
    format: str
    downloaded: frozenset[Path] = frozenset()  # Hub cache files its registration fetched (deleted by `unregister`)


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
    ):
        if slots < 1 or max_batch < 1:
            raise ValueError(f"slots and max_batch must be at least 1, got {slots} and {max_batch}.")
        mixed = max_batch > 1
        if zero_gpu and (mixed or compile):
            raise ValueError(
                f"On ZeroGPU the engine runs eager with max_batch=1 (got compile={compile}, max_batch="
                f"{max_batch}): torch.compile is unavailable there, and the move to the GPU worker splits "
                "the stacked tensors that mixed batches share."
            )
        if aot_package is not None and (compile or mixed):
            raise ValueError(
                "aot_package replaces torch.compile and serves one request per pipeline call: pass "
                "compile=False and max_batch=1."
            )
        resident = device_slots or (max(slots, max_batch) if mixed else slots)
        if resident < slots or (not mixed and resident != slots):
            raise ValueError(
                f"device_slots ({resident}) must be at least slots ({slots}), and differ from it only "
                f"with max_batch > 1."
            )
        if compile is None:  # auto: compile on CUDA (see the class docstring for why not on the CPU)
            compile = aot_package is None and pipe.device.type == "cuda" and not zero_gpu
        no_compiler = compile_cache.missing_compiler(pipe.device) if compile else None
        if no_compiler:
            raise LoraManagerError(f"{no_compiler}. Install one, or run eager (compile=False, app: --no-compile).")
        t0 = time.perf_counter()
        # seconds per start-up phase, in order (from_preset adds the pipeline load, the app its imports)
        self.startup_s: dict[str, float] = {}
        self.pipe = pipe
        self.catalog = catalog or Catalog(name="custom", base_model=getattr(pipe, "name_or_path", "") or "")
        self._root = Path(catalog_root) if catalog_root else None
        self.base_model = resolve_base_model(self.catalog, self._root) if self._root else self.catalog.base_model
        # as a user knows it: a Hub id, or the preset's own folder by its catalog-relative name (never a server path)
        local = self.base_model != self.catalog.base_model
        self.model_name = f"{self.catalog.name}/{self.catalog.base_model}" if local else self.catalog.base_model
        self.generation_defaults = dict(self.catalog.generation)
        self._lock = threading.RLock()
        self.components = {
            n: getattr(pipe, n) for n in pipe._lora_loadable_modules if getattr(pipe, n, None) is not None
        }
        self.denoiser_name = "transformer" if "transformer" in self.components else "unet"
        self.dtype = self.components[self.denoiser_name].dtype
        # page-locked host memory makes host-to-GPU copies async; ZeroGPU's main process must not touch CUDA at all
        self.store = AdapterStore(
            cache_bytes, pin_memory=pipe.device.type == "cuda" and not zero_gpu, on_evict=lambda _, w: self._forget(w)
        )
        self._registered: dict[str, _Registered] = {}
        self.errors: dict[str, str] = {}  # catalog adapters refused at start-up, with their reason
        self._live: list[str | None] = [None] * resident  # the adapter id each device slot holds
        self._last_used: dict[str, int] = {}  # adapter id -> the batch that last needed it (evict the oldest)
        self._batches = 0
        self._swap_ms: list[float] = []
        self.compile_s: float | None = None
        self._recompiles = 0
        self._warm = False
        self.max_batch = max_batch
        self._rows = BatchRows(max_batch, slots, pipe.device) if mixed else None
        self._prefetch = DevicePrefetch(pipe.device, resident) if mixed and pipe.device.type == "cuda" else None

        staged = {}
        for spec in self.catalog.adapters:
            try:
                staged[spec.id] = self._read(spec, allow_local=True, template=None, target_rank=None)
            except LoraManagerError as e:
                self.errors[spec.id] = str(e)
                log.warning("catalog adapter refused: %s", e)
        self.startup_s["adapter_reads"] = time.perf_counter() - t0
        self.target_rank = (
            target_rank or self.catalog.target_rank or max((w.rank for _, w in staged.values()), default=8)
        )
        for adapter_id, (_reg, weights) in list(staged.items()):
            if weights.rank > self.target_rank:
                self.errors[adapter_id] = (
                    f"Adapter {adapter_id!r}: rank {weights.rank} > target_rank {self.target_rank}; "
                    f"restart with --target-rank {weights.rank}."
                )
                del staged[adapter_id]
        keys = set().union(*(reg.keys for reg, _ in staged.values())) or self._default_keys()
        self.device_slots, self._gathered = prepare_template(
            pipe, self.components, keys, self.target_rank, resident, self._rows
        )
        self.slots: list[LiveSlot] = self.device_slots[:slots]  # a request combines up to len(slots) adapters
        for adapter_id, (reg, weights) in staged.items():
            self._registered[adapter_id] = reg
            self.store.put(adapter_id, weights)
        self.scheduler = Scheduler(
            self._run_batch,
            lambda: frozenset(filter(None, self._live)),
            max_queue=max_queue,
            max_batch=max_batch,
            capacity=resident,
        )
        self.compiled = compile
        self.compile_source = "eager"
        self._cache_counts = (0, 0)  # inductor FX graph cache (hits, misses) while this engine compiled
        self._built_kernels = 0  # C++ kernels inductor built meanwhile (CPU)
        self.startup_s["template"] = time.perf_counter() - t0 - sum(self.startup_s.values())
        self.aot: AotDenoiser | None = None
        if compile:
            self.compile_source = self._compile(compile_kwargs or {}, compile_bundle)  # adds its phases to startup_s
        elif aot_package is not None:  # the denoiser runs an AOTInductor package bound to the template's tensors
            self.aot = load_denoiser(pipe, aot_package)
            self.compiled, self.compile_source = True, f"AOTInductor package ({Path(aot_package).name})"
            self.startup_s["aot_load"] = time.perf_counter() - t0 - sum(self.startup_s.values())
        _OPEN.add(self)

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
                CUDA device (`"cuda"`, `"cuda:1"`) and float32 on the CPU.
        """
        from diffusers import DiffusionPipeline

        t0 = time.perf_counter()
        catalog, root = load_preset(name)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = resolve_dtype(dtype, catalog.torch_dtype, device)
        with quiet_loads():
            pipe = DiffusionPipeline.from_pretrained(resolve_base_model(catalog, root), dtype=dtype).to(device)
        pipe.set_progress_bar_config(disable=True)
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
        if allow_local and is_local_source(source):  # a path the caller typed is relative to their working directory
            source = str(Path(source).expanduser().absolute())
        spec = AdapterSpec(id=adapter_id, source=source, weight_name=weight_name, revision=revision, **spec_fields)
        known = self._registered.get(adapter_id)
        if known is not None and (known.spec.source, known.spec.weight_name) != (source, weight_name):
            raise LoraManagerError(f"Adapter id {adapter_id!r} is already used for {known.spec.source!r}.", adapter_id)
        cached = hub_cache_files(source)
        try:
            reg, weights = self._read(
                spec, allow_local, template=self.slots[0].keys, target_rank=self.target_rank, max_bytes=max_bytes
            )
        except BaseException:
            remove_files(hub_cache_files(source) - cached)
            raise
        downloaded = frozenset(hub_cache_files(source) - cached) | (known.downloaded if known else frozenset())
        with self._lock:
            self.store.put(adapter_id, weights)
            self._registered[adapter_id] = replace(reg, downloaded=downloaded)
            self.errors.pop(adapter_id, None)
        return self._info(adapter_id)

    def unregister(self, adapter_id: str) -> None:
        """Forget an adapter: no request can name it any more, its CPU-cache entry goes (once it is not live), and
        the Hub cache files its registration downloaded are deleted unless another adapter reads the same file."""
        with self._lock:
            reg = self._require(adapter_id)
            del self._registered[adapter_id]
            if adapter_id not in self._live:
                self.store.discard(adapter_id)
            shared = {(r.spec.source, r.spec.weight_name, r.spec.revision) for r in self._registered.values()}
            if (reg.spec.source, reg.spec.weight_name, reg.spec.revision) not in shared:
                remove_files(set(reg.downloaded))

    def adapter_byte_limit(self, cap_bytes: int | None = None) -> int:
        """The largest adapter file worth fetching: what the template could hold (rank `target_rank` on every module
        of its union, text encoder included, 4 bytes a value), with room for the file's header and alphas, or
        `cap_bytes` if smaller."""
        values = sum(m.A.numel() + m.B.numel() for m in self.slots[0].modules.values())
        limit = int(values * 4 * TEMPLATE_MARGIN) + 2**20
        return min(limit, cap_bytes) if cap_bytes is not None else limit

    def adapters(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(i) for i in self._registered]

    def info(self, adapter_id: str) -> AdapterInfo:
        with self._lock:
            self._require(adapter_id)
            return self._info(adapter_id)

    def spec(self, adapter_id: str) -> AdapterSpec:
        return self._require(adapter_id).spec

    def asset_path(self, relative: str | None) -> Path | None:
        """A catalog file (e.g. a preview image) resolved against the catalog's folder; None if absent."""
        if not relative or self._root is None:
            return None
        path = self._root / relative
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
        req = check_request(prompt, adapter, strength, seed, steps, len(self.slots))
        for adapter_id, _ in req.adapters:
            self._require(adapter_id)
        params = {**self.generation_defaults, **pipe_kwargs}
        if req.steps is not None:
            params["num_inference_steps"] = req.steps
        return self.scheduler.submit(Request(req.prompt, req.adapters, req.seed, params))

    def _run_batch(self, requests: list[Request]) -> list[Result | BaseException]:
        """Run queued requests as one pipeline call (the scheduler's worker calls this, one batch at a time): with one
        request at a time its adapters go into the slots; in a mixed batch each row picks its own device slots, and
        an adapter refused on its way in fails only the requests that named it."""
        first = requests[0]
        with self._lock:
            if self._rows is None:
                swap_ms, refused = self._activate(first.adapters), {}
            else:
                swap_ms, refused = self._activate_rows(requests)
            runnable = [r for r in requests if not refused.keys() & r.adapter_ids]
            images, generate_ms = self._call(runnable) if runnable else ([], 0.0)
            recompiles = self.recompiles
        shared = {k: v for k, v in first.params.items() if isinstance(v, (int, float, str, bool, type(None)))}
        results = iter(images)
        return [
            refused[min(refused.keys() & r.adapter_ids)]
            if refused.keys() & r.adapter_ids
            else Result(
                image=next(results),
                info={
                    **_describe(r.adapters),
                    "seed": r.seed,
                    "prompt": r.prompt,
                    "prompt_truncated": self._truncated(r.prompt),
                    **shared,
                    "swap_ms": swap_ms,
                    "generate_ms": generate_ms,
                    "batch_size": len(runnable),
                    "compiled": self.compiled,
                    "dtype": self.dtype_name,
                    "recompiles": recompiles,
                    "base_model": self.model_name,
                },
            )
            for r in requests
        ]

    def _call(self, requests: list[Request]) -> tuple[list, float]:
        """One pipeline call for `requests` (same params). Counts graphs compiled during the call as recompiles."""
        prompts = [r.prompt for r in requests]
        generators = [torch.Generator("cpu").manual_seed(r.seed) for r in requests]
        single = len(requests) == 1  # plain diffusers' own call shape, so `info` reproduces it exactly
        if self._prefetch is not None:
            self._stage_upcoming()
        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        images = self.pipe(
            prompts[0] if single else prompts, generator=generators[0] if single else generators, **requests[0].params
        ).images
        generate_ms = (time.perf_counter() - t0) * 1e3
        if self._warm:
            self._recompiles += counters["stats"]["unique_graphs"] - graphs
        return images, generate_ms

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "live": list(self._live),
                "swaps": len(self._swap_ms),
                "swap_ms_last": self._swap_ms[-1] if self._swap_ms else None,
                "swap_ms_median": statistics.median(self._swap_ms) if self._swap_ms else None,
                "compiled": self.compiled,
                "dtype": self.dtype_name,
                "compile_s": self.compile_s,
                "compile_source": self.compile_source,
                "compile_cache_hits": self._cache_counts[0],
                "compile_cache_misses": self._cache_counts[1],
                "compile_built_kernels": self._built_kernels,
                "recompiles": self.recompiles,
                "target_rank": self.target_rank,
                "slots": len(self.slots),
                "device_slots": len(self.device_slots),
                "max_batch": self.max_batch,
                "batches": self.scheduler.stats.batches,
                "template_modules": len(self.slots[0].modules),
                "cache_entries": len(self.store.entries()),
                "cache_bytes": self.store.nbytes,
                "cache_budget_bytes": self.store.budget_bytes,
                "cache_hits": self.store.stats.hits,
                "cache_misses": self.store.stats.misses,
                "cache_evictions": self.store.stats.evictions,
                "queued": self.scheduler.pending(),
                "adapter_changes": self.scheduler.stats.adapter_changes,
                "max_wait_s": self.scheduler.stats.max_wait_s,
                "wait_p50_s": self.scheduler.stats.wait_percentile(50),
                "wait_p95_s": self.scheduler.stats.wait_percentile(95),
            }

    @property
    def recompiles(self) -> int:
        """Graphs compiled during this engine's generations after its warm-up compile."""
        return self._recompiles

    # ---- internals (callers hold the lock where model state is touched) -------------------------------------------

    def _activate(self, mix: Mix) -> float:
        """Make exactly `mix` live, each adapter at its strength. Every read and check runs before the first write,
        so a refused adapter leaves every slot as it was."""
        wanted = dict(mix)
        before = set(filter(None, self._live))
        targets = assign_slots(self._live, list(wanted))
        # every adapter that lands in a slot it is not in yet, including live ones that move to keep id order
        incoming = list(
            dict.fromkeys(a for a, held in zip(targets, self._live, strict=True) if a is not None and a != held)
        )
        fetched: dict[str, AdapterWeights] = {}
        try:
            for adapter_id in incoming:
                fetched[adapter_id] = self._weights(adapter_id)
                self.store.pin(adapter_id)  # so fetching the next one cannot evict it
        except BaseException:
            for adapter_id in fetched:
                if adapter_id not in before:
                    self.store.unpin(adapter_id)
            raise
        t0, swapped = time.perf_counter(), False
        for i, (slot, old, new) in enumerate(zip(self.slots, self._live, targets, strict=True)):
            if new == old:
                if new is not None and wanted[new] != slot.strength:
                    slot.set_strength(wanted[new])
                continue
            slot.load(fetched.get(new), wanted.get(new, 0.0))
            self._live[i], swapped = new, True
        for adapter_id in before - set(targets):
            self.store.unpin(adapter_id)
        return self._swapped(t0) if swapped else 0.0

    def _activate_rows(self, requests: list[Request]) -> tuple[float, dict[str, Exception]]:
        """Make every adapter of a mixed batch resident, then write each row's picks. Every incoming adapter is read
        and checked before the first write; one that is refused (returned with its error) changes nothing and the
        rest of the batch runs. Resident adapters the batch does not need stay unless their slot is wanted."""
        needed = list(dict.fromkeys(a for r in requests for a, _ in r.adapters))
        before = set(filter(None, self._live))
        fetched: dict[str, AdapterWeights] = {}
        refused: dict[str, Exception] = {}
        try:
            for adapter_id in (a for a in needed if a not in before):
                try:
                    fetched[adapter_id] = self._weights(adapter_id)
                except Exception as e:  # noqa: BLE001 - the error is this adapter's requests' answer
                    refused[adapter_id] = e
                    continue
                self.store.pin(adapter_id)  # so fetching the next one cannot evict it
        except BaseException:
            for adapter_id in fetched:
                self.store.unpin(adapter_id)
            raise
        needed = [a for a in needed if a not in refused]
        targets = plan_resident(self._live, needed, self._last_used)
        t0 = time.perf_counter()
        for i, (slot, old, new) in enumerate(zip(self.device_slots, self._live, targets, strict=True)):
            if new != old:
                staged = self._prefetch.take(new, fetched[new]) if self._prefetch is not None else None
                slot.load(fetched[new], 1.0, staged)
                self._live[i] = new
        for adapter_id in before - set(targets):
            self.store.unpin(adapter_id)
        ms = self._swapped(t0) if fetched else 0.0
        if not self.compiled:  # compiled graphs keep the template rank: fixed shapes
            self._fit_ranks()
        self._batches += 1
        self._last_used.update(dict.fromkeys(needed, self._batches))
        slot_of = {a: i for i, a in enumerate(self._live) if a is not None}
        rows = [
            [(slot_of[a], s) for a, s in sorted(r.adapters)] for r in requests if not refused.keys() & r.adapter_ids
        ]
        if rows:
            self._rows.write(rows)
        return ms, refused

    def _swapped(self, t0: float) -> float:
        """Wait once for the copies of every slot a swap loaded; record and return the swap's milliseconds."""
        sync(self.pipe.device)
        ms = (time.perf_counter() - t0) * 1e3
        self._swap_ms.append(ms)
        return ms

    def _fit_ranks(self) -> None:
        """Eager: each layer computes only up to the highest rank a resident adapter has there (the columns above
        are zero in every slot, so the result is the same), and skips itself where none has weights."""
        held = [slot.weights.modules for slot in self.device_slots if slot.weights is not None]
        for key, layer in self._gathered.items():
            layer.rank = max((modules[key].rank for modules in held if key in modules), default=0)

    def _stage_upcoming(self) -> None:
        """CUDA: start copying the adapters queued requests need and the device does not hold (pinned host memory,
        side stream), while this batch runs."""
        wanted = {}
        for adapter_id in self.scheduler.upcoming():
            if adapter_id not in self._live and adapter_id in self.store:
                wanted[adapter_id] = self.store.get(adapter_id)
        self._prefetch.stage(wanted)

    def _forget(self, weights: AdapterWeights) -> None:
        for slot in self.device_slots:
            slot.forget(weights)

    def _weights(self, adapter_id: str) -> AdapterWeights:
        """From the CPU cache, or re-read from disk (and re-checked: the file may have changed) after an eviction."""
        reg = self._require(adapter_id)
        weights = self.store.get(adapter_id)
        if weights is None:
            _, weights = self._read(reg.spec, True, template=self.slots[0].keys, target_rank=self.target_rank)
            weights = self.store.put(adapter_id, weights)
        return weights

    def _read(
        self, spec: AdapterSpec, allow_local: bool, template, target_rank, max_bytes: int | None = None
    ) -> tuple[_Registered, AdapterWeights]:
        path = resolve(spec.source, spec.id, spec.weight_name, spec.revision, allow_local, self._root, max_bytes)
        weights = read_adapter(path, spec.id, type(self.pipe), self.components, self.dtype)
        self.store.check_fits(spec.id, weights)
        check_adapter(spec.id, weights, self.components, template, target_rank)
        reg = _Registered(
            spec=spec,
            keys=frozenset(weights.modules),
            rank=weights.rank,
            alpha=weights.alpha,
            nbytes=weights.nbytes,
            has_text_encoder=weights.has_text_encoder,
            format=weights.format,
        )
        return reg, weights

    def _truncated(self, prompt: str) -> bool:
        """Whether the tokenizer cuts the prompt (CLIP keeps 77 tokens; the tiny model 12): the user is told."""
        tokenizer = getattr(self.pipe, "tokenizer", None)
        return tokenizer is not None and len(tokenizer(prompt).input_ids) > tokenizer.model_max_length

    def _require(self, adapter_id: str) -> _Registered:
        reg = self._registered.get(adapter_id)
        if reg is None:
            reason = self.errors.get(adapter_id)
            raise UnknownAdapterError(
                reason or f"Unknown adapter {shorten(adapter_id)}; registered: {sorted(self._registered)}.", adapter_id
            )
        return reg

    def _info(self, adapter_id: str) -> AdapterInfo:
        reg = self._registered[adapter_id]
        status = "active" if adapter_id in self._live else "cached" if adapter_id in self.store else "evicted"
        return AdapterInfo(
            id=adapter_id,
            source=reg.spec.source,
            rank=reg.rank,
            alpha=reg.alpha,
            num_modules=len(reg.keys),
            bytes=reg.nbytes,
            has_text_encoder=reg.has_text_encoder,
            format=reg.format,
            status=status,
            spec=reg.spec,
        )

    def _default_keys(self) -> set[tuple[str, str]]:
        """The template when the catalog is empty: the denoiser's attention projections."""
        model = self.components[self.denoiser_name]
        return {(self.denoiser_name, n) for n, _ in model.named_modules() if n.endswith(ATTENTION)}

    @property
    def dtype_name(self) -> str:
        """The pipeline's dtype as users write it ("float16")."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def max_adapters(self) -> int:
        """How many adapters one request may combine: the hotswap slots."""
        return len(self.slots)

    @property
    def catalog_root(self) -> Path | None:
        """The catalog's folder (a preset's own), where its previews and compile bundles live."""
        return self._root

    @property
    def compile_key(self) -> compile_cache.BundleKey:
        """What this engine's compiled graphs depend on beyond the code: which compile bundle fits it."""
        generation = {**self.generation_defaults, "max_batch": self.max_batch}
        return compile_cache.bundle_key(
            self.pipe.device,
            self.dtype,
            self.target_rank,
            len(self.device_slots),
            len(self.slots[0].modules),
            generation,
        )

    def _compile(self, compile_kwargs: dict[str, Any], use_bundle: bool) -> str:
        """Install the preset's compile bundle where one fits (unless `use_bundle` is False: compile from nothing, what
        `compile-cache` packs), then compile and warm up; says which it was."""
        t0 = time.perf_counter()
        key = self.compile_key  # once: on the CPU it asks the C++ compiler for its version
        path = compile_cache.bundle_path(self._root, key) if self._root else None
        if not use_bundle:
            skipped = "compile_bundle=False"
        else:
            skipped = compile_cache.install(path, key) if path else "the catalog has no folder"
        self.startup_s["compile_artifacts"] = time.perf_counter() - t0
        if skipped is None and "mode" not in compile_kwargs:  # torch.compile takes `mode` or `options`, not both
            options = {**compile_kwargs.get("options", {}), **compile_cache.OPTIONS}
            compile_kwargs = {**compile_kwargs, "options": options}
        before, kernels = compile_cache.cache_counts(), compile_cache.built_kernels()
        compile_denoiser(self.components[self.denoiser_name], **compile_kwargs)
        # batch sizes 1..B share one graph, dynamic in the batch dimension (unless the caller chose `dynamic`)
        batch_dim = BATCH_DIM if self.max_batch > 1 and "dynamic" not in compile_kwargs else ""
        with torch.compiler.config.patch(dynamic_sources=batch_dim):
            self._warm_up()
        self._cache_counts = tuple(n - b for n, b in zip(compile_cache.cache_counts(), before, strict=True))
        self._built_kernels = compile_cache.built_kernels() - kernels
        if skipped is None and self._cache_counts[1] == 0:
            built = f", {self._built_kernels} C++ kernel(s) built" if self._built_kernels else ""
            return f"artifacts ({path.name}): no graph compiled{built}"
        why = skipped or f"{self._cache_counts[1]} graph(s) were not in {path.name}"
        log.info("compiled the denoiser: %s", why)
        return f"compiled ({why})"

    def _warm_up(self) -> None:
        """Compile now with one short generation per batch size, so no request pays for it (nor recompiles): the
        first compiles the graph (start-up phase "compile": dynamo's trace, then inductor's compile or its cache
        entries); each other size checks that it fits, and on CUDA records its graphs ("warm_up")."""
        defaults = {k: v for k, v in self.generation_defaults.items() if k != "num_inference_steps"}
        seconds = []
        for size in range(1, self.max_batch + 1):
            t0 = time.perf_counter()
            if self._rows is not None:
                self._rows.write([[] for _ in range(size)])
            prompt = "warm-up" if size == 1 else ["warm-up"] * size
            generator = [torch.Generator("cpu").manual_seed(0) for _ in range(size)]
            self.pipe(prompt, num_inference_steps=2, generator=generator[0] if size == 1 else generator, **defaults)
            seconds.append(time.perf_counter() - t0)
        self.startup_s["compile"], self.startup_s["warm_up"] = seconds[0], sum(seconds[1:])
        self.compile_s = sum(seconds)
        self._warm = True


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


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_dtype(dtype: torch.dtype | str | None, catalog_dtype: str | None, device: torch.device) -> torch.dtype:
    """The pipeline's dtype: `dtype` as given (a torch.dtype or its name), else the catalog's on CUDA (half precision
    is what the GPU presets are sized for) and float32 on the CPU (where half precision runs, but slowly)."""
    if dtype is None:
        dtype = catalog_dtype if catalog_dtype and device.type == "cuda" else "float32"
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    return DTYPES[name]


def _describe(mix: Mix) -> dict[str, Any]:
    """`adapter`/`strength` for the info dict: an id and a number for one adapter (None for none), lists for a mix."""
    if len(mix) <= 1:
        return {"adapter": mix[0][0] if mix else None, "strength": mix[0][1] if mix else None}
    return {"adapter": [i for i, _ in mix], "strength": [s for _, s in mix]}
