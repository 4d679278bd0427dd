"""Refusals: what the caller sent, told apart from a failure of the server, with the HTTP status each route answers.

Gradio's direct route (/gradio_api/run/...) answers every error with HTTP 500; a `Refusal` gets its status from its
title there (`RefusalStatus`), an error event on the queue and a modal in the UI.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque

import gradio as gr
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse

from lora_manager import LoraManagerError
from lora_manager.request_schema import shorten
from lora_manager.serving.statuses import RETRY, retry_after_s, status_of

# A refusal's title by its status (`serving/statuses.py`, shared by every route); Gradio's direct route
# (/gradio_api/run/...) answers every error with HTTP 500, and `RefusalStatus` gives it back its status by this title
TITLES = {422: "Invalid request", 404: "Not found", 413: "Too large", 429: "Busy", 503: "Unavailable"}
REFUSAL_STATUS = {title: status for status, title in TITLES.items()}


class Refusal(gr.Error):
    """A request refused for what it asks or while the server cannot serve it, with a message that says what to send
    or when to retry (its status on Gradio's direct route, an error event on its queue, a modal in the UI)."""

    def __init__(self, message: str, title: str = "Invalid request"):
        super().__init__(message, title=title, print_exception=False)


def refusal(error: LoraManagerError) -> gr.Error:
    """The engine's error as the caller sees it, with the status every route gives it; a fault stays a 500."""
    status = status_of(error)
    return Refusal(str(error), TITLES[status]) if status in TITLES else gr.Error(str(error))


class RefusalStatus:
    """ASGI middleware: on Gradio's direct route, a 500 whose JSON body is a Refusal takes the refusal's status, and a
    429 or 503 says when to retry (`Retry-After`: the median time of the route's recent answers, at least 1 s)."""

    DIRECT = ("/gradio_api/run/", "/gradio_api/api/")

    def __init__(self, app):
        self.app = app
        self.latencies: deque[float] = deque(maxlen=64)  # seconds of the direct route's recent successful answers

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(self.DIRECT):
            return await self.app(scope, receive, send)
        held: list[dict] = []  # a 500's start and body, until the whole body is read
        t0 = time.monotonic()

        async def relay(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] == 500:
                held.append(message)
            elif not held:
                if message["type"] == "http.response.start" and message["status"] == 200:
                    self.latencies.append(time.monotonic() - t0)
                await send(message)
            else:
                held.append(message)
                if not message.get("more_body"):
                    body = b"".join(m.get("body", b"") for m in held[1:])
                    status = _refusal_status(body)
                    headers = list(held[0].get("headers", []))
                    if status in RETRY:
                        headers.append((b"retry-after", str(retry_after_s(self.latencies)).encode()))
                    await send({**held[0], "status": status, "headers": headers})
                    await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, relay)


def check_input_count(block_fn, inputs: list) -> None:
    """Gradio's check that an event got a value for each of its inputs (`Blocks.validate_inputs`), as a refusal: 422
    on the direct route, and the counts without echoing the values sent. Extra values are ignored, as Gradio does."""
    if len(inputs) < len(block_fn.inputs):
        name = block_fn.api_name or block_fn.name or "this event"
        raise Refusal(
            f"{shorten(name)} takes one value per input (needed: {len(block_fn.inputs)}, got: {len(inputs)}); "
            "the API page lists them in order."
        )


def _refusal_status(body: bytes) -> int:
    try:
        title = json.loads(body).get("title")
    except (ValueError, AttributeError):
        return 500
    return REFUSAL_STATUS.get(title, 500)


async def refused_body(request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 for a request body its models refuse, without echoing the values: a NaN or Infinity there
    (Python's JSON reader takes them) cannot be written back as JSON and made the answer a bare 500."""
    problems = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in error.errors()]
    where = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in problems)
    message = f"The request body is not valid ({where}); send JSON in the documented shape, numbers finite."
    return JSONResponse({"error": message, "detail": problems}, status_code=422)


def text_field(value, name: str, limit: int) -> str:
    """A UI field as stripped text, refused with the field's name when it is not text or too long."""
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > limit:
        raise Refusal(f"{name} must be text of at most {limit} characters, got {shorten(value)}.")
    return value.strip()


def number_field(value, name: str, default: float) -> float:
    """A UI number as a finite float (`default` when empty), refused with the field's name otherwise."""
    try:
        number = float(value) if value is not None else default
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise Refusal(f"{name} must be a number, got {shorten(value)}.")
    return number
