"""lora_manager: serve a diffusers pipeline with many LoRAs, one per request, hotswapped without recompiling."""

from .quiet import silence_import_notices

silence_import_notices()  # before diffusers is imported below

from .engine import LoraManager  # noqa: E402
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
