"""The engine interface a front end is written against, and the `/generate` wire format.

`Engine` is what `app.py` needs: `LoraManager` (in-process) and `serving.remote.RemoteManager` (a Ray Serve
deployment over HTTP) both provide it. On the wire a request is JSON {"prompt", "adapter", "strength", "seed",
"steps"} (`request_body`) and an answer {"image_png_base64", "info"} (`answer_body`, read by `answer_image`).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from PIL import Image

from ..specs import AdapterInfo, AdapterSpec, Catalog, Result


@runtime_checkable
class Engine(Protocol):
    """A diffusers pipeline serving many LoRAs, one choice per request."""

    catalog: Catalog
    model_name: str  # as a user knows it: a Hub id, or the preset's own folder by its catalog name
    target_rank: int
    generation_defaults: dict[str, Any]
    refused: dict[str, str]  # catalog adapters refused at start-up, with their reason
    compile_source: str  # "eager", or where the compiled graphs came from
    startup_s: dict[str, float]  # seconds per start-up phase

    @property
    def max_adapters(self) -> int:
        """How many adapters one request may combine (hotswap slots)."""

    def adapters(self) -> list[AdapterInfo]: ...

    def spec(self, adapter_id: str) -> AdapterSpec: ...

    def asset_path(self, relative: str | None) -> Path | None: ...

    def register(
        self,
        adapter_id: str,
        source: str,
        weight_name: str | None = None,
        revision: str | None = None,
        allow_local: bool = True,
        max_bytes: int | None = None,
    ) -> AdapterInfo: ...

    def unregister(self, adapter_id: str) -> None: ...

    def adapter_byte_limit(self, cap_bytes: int | None = None) -> int: ...

    def generate(
        self,
        prompt: str,
        adapter: str | list | None = None,
        strength: float = 1.0,
        seed: int = 0,
        steps: int | None = None,
        **pipe_kwargs,
    ) -> Result: ...

    def stats(self) -> dict[str, Any]: ...


def request_body(prompt: str, adapter=None, strength: float = 1.0, seed: int = 0, steps: int | None = None) -> dict:
    """The JSON a client POSTs to /generate."""
    return {"prompt": prompt, "adapter": adapter, "strength": strength, "seed": seed, "steps": steps}


def answer_body(result: Result, **info: Any) -> dict[str, Any]:
    """The JSON /generate answers: the image as base64 PNG, and the result's info with `info` added."""
    buffer = io.BytesIO()
    result.image.save(buffer, format="PNG")
    return {"image_png_base64": base64.b64encode(buffer.getvalue()).decode(), "info": {**result.info, **info}}


def answer_image(answer: dict[str, Any]) -> Image.Image:
    """The image of a /generate answer."""
    return Image.open(io.BytesIO(base64.b64decode(answer["image_png_base64"]))).convert("RGB")
