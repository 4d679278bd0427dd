"""Presets: one folder per preset under `presets/`, each with a `catalog.json`; relative paths resolve there."""

from __future__ import annotations

import json
from pathlib import Path

from ..specs import Catalog

PRESETS_DIR = Path(__file__).parents[1] / "presets"


def preset_names() -> list[str]:
    return sorted(p.parent.name for p in PRESETS_DIR.glob("*/catalog.json"))


def load_catalog(path: str | Path) -> tuple[Catalog, Path]:
    """Read a catalog file; returns it with the folder its relative paths are resolved against."""
    path = Path(path)
    return Catalog.from_dict(json.loads(path.read_text())), path.parent


def load_preset(name: str) -> tuple[Catalog, Path]:
    """A preset by name, or any catalog file by path (a custom catalog for your own base model and LoRAs)."""
    path = Path(name) if name.endswith(".json") else PRESETS_DIR / name / "catalog.json"
    if not path.is_file():
        raise ValueError(f"Unknown preset {name!r}; choose one of {preset_names()} or give a catalog .json path.")
    return load_catalog(path)


def model_names(catalog: Catalog, root: Path | None) -> tuple[str, str]:
    """The base model to load (a Hub id, or the catalog's folder for it) and its name as a user knows it: the Hub id,
    or the preset's own folder by its catalog-relative name (never a server path)."""
    base_model = resolve_base_model(catalog, root) if root else catalog.base_model
    local = base_model != catalog.base_model
    return base_model, f"{catalog.name}/{catalog.base_model}" if local else catalog.base_model


def resolve_base_model(catalog: Catalog, root: Path) -> str:
    """A base model is a Hub id or a folder relative to the catalog."""
    local = root / catalog.base_model
    return str(local) if local.is_dir() else catalog.base_model


VARIANTS = {"float16": "fp16", "bfloat16": "bf16"}  # diffusers' names for a repo's half-precision weight files


def half_variant(base_model: str, dtype: str) -> str | None:
    """The `variant` to load `base_model` with in `dtype`: "fp16" (or "bf16") where the folder or Hub repo has weight
    files of that variant, about half the bytes of its float32 ones to download and read; else None."""
    variant = VARIANTS.get(dtype.removeprefix("torch."))
    if variant is None:
        return None
    return variant if any(f".{variant}." in Path(name).name for name in _files(base_model)) else None


def _files(base_model: str) -> list[str]:
    """A base model's file names: the folder's, the Hub repo's, or (offline) those of its cached snapshot."""
    if Path(base_model).is_dir():
        return [str(p) for p in Path(base_model).rglob("*")]
    from huggingface_hub import constants, list_repo_files, snapshot_download

    if not constants.is_offline_mode():
        try:
            return list_repo_files(base_model)
        except Exception:  # noqa: BLE001 - a Hub that cannot list (unreachable, gated) leaves the cache to ask
            pass
    try:
        return [str(p) for p in Path(snapshot_download(base_model, local_files_only=True)).rglob("*")]
    except Exception:  # noqa: BLE001 - not cached either: load without a variant, as diffusers does by default
        return []
