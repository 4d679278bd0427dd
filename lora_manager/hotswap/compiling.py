"""The denoiser's compile lifecycle: install a compile bundle that fits, compile, warm up every batch size, then
count any graph compiled during a generation as a recompile."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from ..layout import Layout
from . import compile_cache
from .fusion import FusionSwitch
from .rows import BatchRows
from .template import BATCH_DIM, compile_denoiser

log = logging.getLogger(__name__)


class Compilation:
    """Compiles `pipe`'s denoiser once and keeps what that cost: where the graphs came from (`source`), inductor's
    cache hits and misses, C++ kernels built, and the graphs compiled afterwards (`recompiles`)."""

    def __init__(
        self,
        pipe,
        denoiser: torch.nn.Module,
        rows: BatchRows | None,
        layout: Layout,
        generation: dict[str, Any],
        fusion: FusionSwitch | None = None,
    ):
        self._pipe, self._denoiser, self._rows, self._fusion = pipe, denoiser, rows, fusion
        self.layout, self._generation = layout, generation  # the generation: the catalog's pipeline defaults
        self.source = "eager"
        self.compile_s: float | None = None
        self.cache_counts = (0, 0)  # inductor FX graph cache (hits, misses) while this engine compiled
        self.built_kernels = 0  # C++ kernels inductor built meanwhile (CPU)
        self.recompiles = 0
        self._warm = False

    def report(self) -> dict[str, Any]:
        """The compile's part of the engine's `stats()`."""
        return {
            "compile_s": self.compile_s,
            "compile_source": self.source,
            "compile_cache_hits": self.cache_counts[0],
            "compile_cache_misses": self.cache_counts[1],
            "compile_built_kernels": self.built_kernels,
            "recompiles": self.recompiles,
        }

    def compile(
        self,
        key: compile_cache.BundleKey,
        bundle: Path | None,
        use_bundle: bool,
        kwargs: dict[str, Any],
        phases: dict[str, float],
    ) -> str:
        """Install `bundle` where it fits (unless `use_bundle` is False: compile from nothing, what `compile-cache`
        packs), then compile and warm up, adding the phases to `phases`; says where the graphs came from."""
        t0 = time.perf_counter()
        if not use_bundle:
            skipped = "compile_bundle=False"
        else:
            skipped = compile_cache.install(bundle, key) if bundle else "the catalog has no folder"
        phases["compile_artifacts"] = time.perf_counter() - t0
        if skipped is None and "mode" not in kwargs:  # torch.compile takes `mode` or `options`, not both
            kwargs = {**kwargs, "options": {**kwargs.get("options", {}), **compile_cache.OPTIONS}}
        before, kernels = compile_cache.cache_counts(), compile_cache.built_kernels()
        # one whole graph: a graph break would run part of the step eager and cut it out of CUDA graphs
        compile_denoiser(self._denoiser, **{"fullgraph": True, **kwargs})
        # batch sizes 1..B share one graph, dynamic in the batch dimension (unless the caller chose `dynamic`)
        batch_dim = BATCH_DIM if self.layout.mixed and "dynamic" not in kwargs else ""
        with torch.compiler.config.patch(dynamic_sources=batch_dim), torch._inductor.config.patch(self._cpu_patch()):
            self._warm_up(phases)
        self.cache_counts = tuple(n - b for n, b in zip(compile_cache.cache_counts(), before, strict=True))
        self.built_kernels = compile_cache.built_kernels() - kernels
        if skipped is None and self.cache_counts[1] == 0:
            built = f", {self.built_kernels} C++ kernel(s) built" if self.built_kernels else ""
            self.source = f"artifacts ({bundle.name}): no graph compiled{built}"
        else:
            why = skipped or f"{self.cache_counts[1]} graph(s) were not in {bundle.name}"
            log.info("compiled the denoiser: %s", why)
            self.source = f"compiled ({why})"
        return self.source

    def _cpu_patch(self) -> dict[str, Any]:
        """Inductor settings for this compile: on the CPU, a half-precision graph for mixed batches is vectorized at
        256 bits, since torch 2.13's 512-bit half-precision kernels for it give NaN on CPUs with AVX512-FP16."""
        half = self._denoiser.dtype in (torch.float16, torch.bfloat16)
        cpu_mixed_half = self._denoiser.device.type == "cpu" and half and self.layout.mixed
        return {"cpp.simdlen": 256} if cpu_mixed_half else {}

    def _warm_up(self, phases: dict[str, float]) -> None:
        """One short generation per batch size, with the LoRA forward and (where the engine fuses) with the base
        weights alone, so no request pays for compiling (nor recompiles): the first compiles the graph (phase
        "compile": dynamo's trace, then inductor's compile or its cache entries); each other size checks that it
        fits, and on CUDA records its graphs; the fused forward is its own graph ("warm_up")."""
        defaults = {k: v for k, v in self._generation.items() if k != "num_inference_steps"}
        seconds = []
        for fused in (False, True) if self._fusion is not None else (False,):
            if self._fusion is not None:
                self._fusion.on = fused  # the base weights are pristine: nothing is merged yet
            for size in range(1, self.layout.max_batch + 1):
                t0 = time.perf_counter()
                if self._rows is not None:  # mixed: every row of the warm-up runs no adapter
                    self._rows.write([[] for _ in range(size)])
                prompt = "warm-up" if size == 1 else ["warm-up"] * size
                generators = [torch.Generator("cpu").manual_seed(0) for _ in range(size)]
                generator = generators[0] if size == 1 else generators
                self._pipe(prompt, num_inference_steps=2, generator=generator, **defaults)
                seconds.append(time.perf_counter() - t0)
        if self._fusion is not None:
            self._fusion.on = False
        phases["compile"], phases["warm_up"] = seconds[0], sum(seconds[1:])
        self.compile_s = sum(seconds)
        self._warm = True

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count the graphs compiled inside the block as recompiles, once warm."""
        graphs = counters["stats"]["unique_graphs"]
        yield
        if self._warm:
            self.recompiles += counters["stats"]["unique_graphs"] - graphs
