"""lora_manager: serve a diffusers pipeline with many LoRAs, one per request, hotswapped without recompiling."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .quiet import silence_import_notices

silence_import_notices()  # before any module of the package imports diffusers

from .errors import (  # noqa: E402
    AdapterFormatError,
    AdapterIncompatibleError,
    AdapterSourceError,
    AdapterTooLargeError,
    AdapterValueError,
    CacheBudgetError,
    LoraManagerError,
    QueueFullError,
    RequestError,
    UnknownAdapterError,
)
from .specs import AdapterInfo, AdapterSpec, Catalog, Result  # noqa: E402

if TYPE_CHECKING:
    from .engine import LoraManager

__all__ = [
    "AdapterFormatError",
    "AdapterIncompatibleError",
    "AdapterInfo",
    "AdapterSourceError",
    "AdapterSpec",
    "AdapterTooLargeError",
    "AdapterValueError",
    "CacheBudgetError",
    "Catalog",
    "LoraManager",
    "LoraManagerError",
    "QueueFullError",
    "RequestError",
    "Result",
    "UnknownAdapterError",
]


def __getattr__(name: str):
    """`LoraManager` is imported on first use (PEP 562): the engine imports torch and diffusers, which the pure
    modules (scheduler, request schema, plans, routing) and the code that only needs them never load."""
    if name == "LoraManager":
        from .engine import LoraManager

        return LoraManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
