"""lora_manager: serve a diffusers pipeline with many LoRAs, one per request, hotswapped without recompiling."""

from .engine import LoraManager
from .errors import (
    AdapterFormatError,
    AdapterIncompatibleError,
    AdapterSourceError,
    AdapterValueError,
    CacheBudgetError,
    LoraManagerError,
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
    "RequestError",
    "Result",
    "UnknownAdapterError",
]
