"""Frozen dataclasses for catalog entries, adapter descriptions and results; no raw dicts past the loader."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

DTYPE_NAMES = ("float16", "bfloat16", "float32")  # the pipeline dtypes the engine serves in, as users write them


def _from_dict(cls: type, data: dict[str, Any], where: str):
    """Build a dataclass from a dict, naming every missing and unknown key at once."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = {
        n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    unknown = sorted(set(data) - set(fields))
    missing = sorted(required - set(data))
    if unknown or missing:
        parts = [f"missing keys {missing}" if missing else "", f"unknown keys {unknown}" if unknown else ""]
        raise ValueError(f"{where}: {'; '.join(p for p in parts if p)} (allowed: {sorted(fields)})")
    return cls(**data)


@dataclass(frozen=True)
class AdapterSpec:
    """One catalog entry: where an adapter comes from and how the UI presents it."""

    id: str
    source: str  # Hub "user/repo" or a local .safetensors path
    weight_name: str | None = None
    revision: str | None = None
    name: str = ""
    trigger: str = ""
    strength: float = 1.0
    preview: str | None = None
    license: str | None = None
    description: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AdapterSpec:
        return _from_dict(cls, data, f"adapter {data.get('id', '?')!r}")

    @property
    def display_name(self) -> str:
        return self.name or self.id


@dataclass(frozen=True)
class Catalog:
    """A preset: base model, generation defaults and the adapters it serves."""

    name: str
    base_model: str
    adapters: tuple[AdapterSpec, ...] = ()
    description: str = ""
    generation: dict[str, Any] = field(default_factory=dict)
    torch_dtype: str | None = None  # e.g. "float16" on GPU presets; None keeps the checkpoint's dtype
    target_rank: int | None = None  # fixed rank for the preset; None means the catalog's largest rank
    hardware: str | None = None  # suggested Space hardware

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Catalog:
        data = dict(data)
        data["adapters"] = tuple(AdapterSpec.from_dict(a) for a in data.get("adapters", ()))
        catalog = _from_dict(cls, data, f"catalog {data.get('name', '?')!r}")
        ids = [a.id for a in catalog.adapters]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"catalog {catalog.name!r}: duplicate adapter ids {dupes}")
        return catalog


@dataclass(frozen=True)
class AdapterInfo:
    """What the engine knows about a registered adapter, read from its file."""

    id: str
    source: str
    rank: int  # largest rank over its modules
    alpha: float  # alpha of the module with the largest rank
    num_modules: int  # number of target modules, all components
    bytes: int  # CPU-memory size of its weights as held by the cache
    has_text_encoder: bool
    format: str  # key layout family: "kohya", "peft", "peft+alpha", "diffusers", "xlabs", "comfyui" or "other"
    status: str  # "cached", "active", "evicted" (re-read on demand)
    disk_bytes: int = 0  # Hub cache files its registration downloaded (0: read from a path or an earlier download)
    spec: AdapterSpec | None = None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("spec")
        return d


@dataclass(frozen=True)
class Result:
    """A generated image and everything needed to reproduce it with plain diffusers."""

    image: Image.Image
    info: dict[str, Any]
