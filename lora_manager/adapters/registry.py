"""The adapters requests may name: each one's catalog entry and what its file says, the catalog entries refused with
their reasons, and the reading and checking that admits an adapter. Nothing here touches a model."""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import LoraManagerError, UnknownAdapterError
from ..request_schema import shorten
from ..specs import AdapterInfo, AdapterSpec
from .loader import AdapterLoader
from .reader import AdapterWeights, read_adapter
from .sources import hub_cache_files, is_local_source, remove_files, resolve
from .store import AdapterStore
from .validate import check_adapter

log = logging.getLogger(__name__)

TEMPLATE_MARGIN = 1.25  # a file's header, alpha tensors and fp32 padding on top of its template-sized tensors
FETCH_LOCKS = 64  # registrations from one Hub repo run one at a time; other repos rarely share a lock


@dataclass(frozen=True)
class RegisteredAdapter:
    """A registered adapter: its catalog entry and what its file says (kept even when evicted from RAM)."""

    spec: AdapterSpec
    keys: frozenset[tuple[str, str]]
    rank: int
    alpha: float
    nbytes: int
    has_text_encoder: bool
    format: str
    downloaded: frozenset[Path] = frozenset()  # Hub cache files its registration fetched (deleted by `unregister`)
    disk_bytes: int = 0  # what those files take on disk

    @classmethod
    def of(cls, spec: AdapterSpec, weights: AdapterWeights) -> RegisteredAdapter:
        return cls(
            spec=spec,
            keys=frozenset(weights.modules),
            rank=weights.rank,
            alpha=weights.alpha,
            nbytes=weights.nbytes,
            has_text_encoder=weights.has_text_encoder,
            format=weights.format,
        )


@dataclass(frozen=True)
class Template:
    """What every adapter is checked against once the hotswap template exists: its modules and rank."""

    keys: frozenset[tuple[str, str]]
    rank: int


class AdapterRegistry:
    """Reads adapter files for a pipeline's components, checks them against the template, and keeps the checked
    weights in the CPU cache (`store`); `loader` re-reads evicted ones in the background. Its callers hold the
    engine's lock for every change."""

    def __init__(
        self,
        store: AdapterStore,
        pipeline_cls: type,
        components: dict[str, torch.nn.Module],
        dtype: torch.dtype,
        root: Path | None,
    ):
        self.store = store
        self._pipeline_cls, self._components, self._dtype, self._root = pipeline_cls, components, dtype, root
        self.template: Template | None = None  # None until the engine has sized it from the catalog
        self._entries: dict[str, RegisteredAdapter] = {}
        self.refused: dict[str, str] = {}  # catalog adapters refused at start-up, with their reason
        self.loader = AdapterLoader(self.reread, store.__contains__)
        self._fetching = [threading.Lock() for _ in range(FETCH_LOCKS)]

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._entries

    def ids(self) -> list[str]:
        return list(self._entries)

    def read(
        self, spec: AdapterSpec, allow_local: bool = True, max_bytes: int | None = None
    ) -> tuple[RegisteredAdapter, AdapterWeights]:
        """Fetch and read `spec`'s file, and check that it fits the CPU cache and the template."""
        path = resolve(spec.source, spec.id, spec.weight_name, spec.revision, allow_local, self._root, max_bytes)
        weights = read_adapter(path, spec.id, self._pipeline_cls, self._components, self._dtype)
        self.store.check_fits(spec.id, weights)
        template = self.template
        check_adapter(
            spec.id, weights, self._components, set(template.keys) if template else None, template and template.rank
        )
        return RegisteredAdapter.of(spec, weights), weights

    def read_catalog(self, specs: Iterable[AdapterSpec]) -> dict[str, tuple[RegisteredAdapter, AdapterWeights]]:
        """Read every catalog adapter before the template exists (it is sized from them); refusals are recorded."""
        staged = {}
        for spec in specs:
            try:
                staged[spec.id] = self.read(spec)
            except LoraManagerError as e:
                self.refuse(spec.id, str(e))
        return staged

    def admit_catalog(self, staged: dict[str, tuple[RegisteredAdapter, AdapterWeights]]) -> None:
        """Once the template exists: admit the catalog adapters it can hold; refuse those above its rank."""
        for adapter_id, (reg, weights) in staged.items():
            if weights.rank > self.template.rank:
                self.refuse(
                    adapter_id,
                    f"Adapter {adapter_id!r}: rank {weights.rank} > target_rank {self.template.rank}; "
                    f"restart with --target-rank {weights.rank}.",
                )
            else:
                self.add(reg, weights)

    def refuse(self, adapter_id: str, reason: str) -> None:
        self.refused[adapter_id] = reason
        log.warning("catalog adapter refused: %s", reason)

    def add(self, reg: RegisteredAdapter, weights: AdapterWeights) -> None:
        self.store.put(reg.spec.id, weights, always=True)
        self._entries[reg.spec.id] = reg
        self.refused.pop(reg.spec.id, None)

    def register(self, spec: AdapterSpec, allow_local: bool, max_bytes: int | None, lock) -> RegisteredAdapter:
        """Read and check `spec` (without `lock`: a download may take seconds), then admit it under `lock`. What a
        refused Hub file downloaded is removed from the Hub cache again, unless it was cached before."""
        known = self._entries.get(spec.id)
        if known is not None and (known.spec.source, known.spec.weight_name) != (spec.source, spec.weight_name):
            raise LoraManagerError(f"Adapter id {spec.id!r} is already used for {known.spec.source!r}.", spec.id)
        # one at a time per repo, so what a refused registration removes is only what it downloaded itself
        with self._fetching[hash(spec.source) % FETCH_LOCKS]:
            cached = hub_cache_files(spec.source)
            try:
                reg, weights = self.read(spec, allow_local, max_bytes)
            except BaseException:
                remove_files(hub_cache_files(spec.source) - cached)
                raise
            fresh = hub_cache_files(spec.source) - cached
        disk_bytes = sum(p.lstat().st_size for p in fresh if not p.is_symlink())
        if known is not None:
            fresh, disk_bytes = fresh | known.downloaded, disk_bytes + known.disk_bytes
        reg = replace(reg, downloaded=frozenset(fresh), disk_bytes=disk_bytes)
        with lock:
            self.add(reg, weights)
        return reg

    def unregister(self, adapter_id: str, live: Collection[str]) -> None:
        """Forget an adapter and its CPU-cache entry (once it is not `live`); delete the Hub cache files its
        registration downloaded unless another adapter reads the same file."""
        reg = self.require(adapter_id)
        del self._entries[adapter_id]
        if adapter_id not in live:
            self.store.discard(adapter_id)
        shared = {(r.spec.source, r.spec.weight_name, r.spec.revision) for r in self._entries.values()}
        if (reg.spec.source, reg.spec.weight_name, reg.spec.revision) not in shared:
            remove_files(set(reg.downloaded))

    def require(self, adapter_id: str) -> RegisteredAdapter:
        reg = self._entries.get(adapter_id)
        if reg is None:
            reason = self.refused.get(adapter_id)
            raise UnknownAdapterError(
                reason or f"Unknown adapter {shorten(adapter_id)}; registered: {sorted(self._entries)}.", adapter_id
            )
        return reg

    def reread(self, adapter_id: str) -> AdapterWeights:
        """Read and check a registered adapter again (the file may have changed since), without the engine's lock."""
        return self.read(self.require(adapter_id).spec)[1]

    def weights(self, adapter_id: str) -> AdapterWeights:
        """From the CPU cache, else the loader's background read, else read now (the worker's batch waits)."""
        self.require(adapter_id)
        weights = self.store.get(adapter_id)
        if weights is None:
            weights = self.loader.take(adapter_id)
            if weights is None:
                self.store.stats.worker_reads += 1
                weights = self.reread(adapter_id)
            weights = self.store.put(adapter_id, weights)
        return weights

    def info(self, adapter_id: str, live: Collection[str]) -> AdapterInfo:
        reg = self.require(adapter_id)
        status = "active" if adapter_id in live else "cached" if adapter_id in self.store else "evicted"
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
            disk_bytes=reg.disk_bytes,
            spec=reg.spec,
        )


def local_spec(adapter_id: str, source: str, allow_local: bool, **fields) -> AdapterSpec:
    """The spec `register` reads: a local path the caller typed is made absolute against their working directory."""
    if allow_local and is_local_source(source):
        source = str(Path(source).expanduser().absolute())
    return AdapterSpec(id=adapter_id, source=source, **fields)
