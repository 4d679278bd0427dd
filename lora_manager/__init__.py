"""lora_manager: serve a diffusers pipeline with many LoRAs, one per request, hotswapped without recompiling."""

from .engine import LoraManager
from .errors import (
    AdapterFormatError,
    AdapterIncompatibleError,
    AdapterSourceError,
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
