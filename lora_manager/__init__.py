"""lora_manager: serve a diffusers pipeline with many LoRAs, one per request, hotswapped without recompiling."""

from .engine import LoraManager
from .errors import (
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
from .specs import AdapterInfo, AdapterSpec, Catalog, Result

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
