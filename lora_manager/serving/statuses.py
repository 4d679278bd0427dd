"""One table from the engine's errors to HTTP statuses, shared by the Space's routes, `/generate` and the OpenAI
routes, so the same bad request gets the same status everywhere (FastAPI's convention): 422 a bad field, 404 an
unknown model or adapter, 413 a body over the limit, 429 a full queue (with `Retry-After`), 503 a server that cannot
serve now (closed, its replicas lost), 500 a fault of the server."""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection

from ..errors import (
    BodyTooLargeError,
    EngineClosedError,
    LoraManagerError,
    NotFoundError,
    QueueFullError,
    ReplicasLostError,
    RequestError,
    UnknownAdapterError,
)

# (error class, status), most specific first: the first class an error is an instance of gives its status
STATUSES: tuple[tuple[type[LoraManagerError], int], ...] = (
    (BodyTooLargeError, 413),
    (NotFoundError, 404),
    (UnknownAdapterError, 404),
    (QueueFullError, 429),
    (EngineClosedError, 503),
    (ReplicasLostError, 503),
    (RequestError, 422),
)
FAULT = 500
RETRY = (429, 503)  # the statuses a client may retry, told when by `Retry-After`


def retry_after_s(latencies: Collection[float]) -> int:
    """`Retry-After` in seconds: the median of recent answers' latencies, at least one."""
    return max(1, math.ceil(statistics.median(latencies))) if latencies else 1


def status_of(error: LoraManagerError) -> int:
    """The HTTP status of an engine error. Every other `LoraManagerError` subclass is the adapter a request named
    failing its checks (422); a bare `LoraManagerError` is a fault of the server (500)."""
    for kind, status in STATUSES:
        if isinstance(error, kind):
            return status
    return FAULT if type(error) is LoraManagerError else 422


def error_of(status: int, message: str, field: str | None = None) -> LoraManagerError:
    """The error a status stands for, rebuilt on the far side of a call (a Ray replica's answer, an HTTP client), so
    `status_of` gives the same status again."""
    kinds = {413: BodyTooLargeError, 404: NotFoundError, 422: RequestError}
    if status in kinds:
        return kinds[status](message, field=field)
    kind = {429: QueueFullError, 503: ReplicasLostError}.get(status, LoraManagerError)
    return kind(message)
