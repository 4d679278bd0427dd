"""The engine's own exceptions: each names the adapter, what is wrong against its limit, and the fix."""

from __future__ import annotations


class LoraManagerError(Exception):
    """Base class; `adapter_id` names the adapter at fault (None when no adapter is involved)."""

    def __init__(self, message: str, adapter_id: str | None = None):
        super().__init__(message)
        self.adapter_id = adapter_id


class AdapterSourceError(LoraManagerError):
    """The source cannot be resolved: bad repo id or path, missing file, pickle file, Hub error."""


class AdapterTooLargeError(AdapterSourceError):
    """The file is larger than the limit for an adapter: refused before it is downloaded."""


class AdapterFormatError(LoraManagerError):
    """The file is not a readable LoRA safetensors file of a supported kind."""


class AdapterIncompatibleError(LoraManagerError):
    """The adapter does not fit this base model or the prepared hotswap template."""


class AdapterValueError(LoraManagerError):
    """The adapter's weights hold NaN or Inf."""


class UnknownAdapterError(LoraManagerError):
    """No adapter with that id is registered."""


class CacheBudgetError(LoraManagerError):
    """The adapter alone is larger than the CPU cache's byte budget."""


class RequestError(LoraManagerError):
    """A request field has the wrong type, is out of range or too long; `field` names it."""

    def __init__(self, message: str, field: str | None = None, adapter_id: str | None = None):
        super().__init__(message, adapter_id)
        self.field = field


class NotFoundError(RequestError):
    """A request names a model or adapter that does not exist; `field` names where."""


class BodyTooLargeError(RequestError):
    """A request body over the server's limit, refused before it is parsed."""


class QueueFullError(LoraManagerError):
    """The request queue is full: the server is busy and the client should retry."""


class EngineClosedError(LoraManagerError):
    """The engine was closed: it serves no more requests."""


class ReplicasLostError(LoraManagerError):
    """Every replica tried for a request died under it."""
