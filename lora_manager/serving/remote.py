"""The app's engine when generation runs on Ray Serve (`python app.py --backend ray --ray-url URL`).

`RemoteManager` is an `Engine` (`protocol.py`), the interface `app.py` is written against. The catalog (names, triggers,
previews) comes from the same preset on local disk; adapters, slots and stats from the deployment's `GET /info`;
images from `POST /generate`. Adding a LoRA from the UI needs the engine in-process and is refused here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from ..adapters.catalog import load_preset, resolve_base_model
from ..errors import LoraManagerError
from ..specs import AdapterInfo, AdapterSpec, Result
from .protocol import answer_image, request_body
from .statuses import error_of

TIMEOUT_S = 600


class RemoteManager:
    """A `LoraManager` look-alike that forwards generation to a Ray Serve deployment of
    `lora_manager.serving.ray_app`."""

    def __init__(self, url: str, preset: str = "tiny"):
        self.url = url.rstrip("/")
        self.catalog, self._root = load_preset(preset)
        self.base_model = resolve_base_model(self.catalog, self._root)
        local = self.base_model != self.catalog.base_model
        self.model_name = f"{self.catalog.name}/{self.catalog.base_model}" if local else self.catalog.base_model
        self.generation_defaults = dict(self.catalog.generation)
        info = self._get("/info")
        self.target_rank: int = info["target_rank"]
        self.max_adapters: int = info["slots"]
        self.compiled: bool = info["compiled"]
        self.compile_source: str = info["stats"].get("compile_source", "unknown")
        self.refused: dict[str, str] = info["refused"]
        self.startup_s: dict[str, float] = info["startup_s"]

    def adapters(self) -> list[AdapterInfo]:
        specs = {a.id: a for a in self.catalog.adapters}
        return [AdapterInfo(**a, spec=specs.get(a["id"])) for a in self._get("/info")["adapters"]]

    def spec(self, adapter_id: str) -> AdapterSpec:
        spec = next((a for a in self.catalog.adapters if a.id == adapter_id), None)
        if spec is None:
            raise LoraManagerError(f"Unknown adapter {adapter_id!r}.", adapter_id)
        return spec

    def asset_path(self, relative: str | None) -> Path | None:
        path = self._root / relative if relative else None
        return path if path is not None and path.is_file() else None

    def stats(self) -> dict[str, Any]:
        return self._get("/info")["stats"]

    def register(self, adapter_id: str, source: str, **_) -> AdapterInfo:
        raise LoraManagerError(
            f"Adapter {adapter_id!r}: adding LoRAs from the UI needs the in-process engine; with the Ray backend add "
            "it to the preset's catalog and redeploy.",
            adapter_id,
        )

    def unregister(self, adapter_id: str) -> None:
        raise LoraManagerError(
            f"Adapter {adapter_id!r}: the Ray backend serves its deployment's catalog only.", adapter_id
        )

    def adapter_byte_limit(self, cap_bytes: int | None = None) -> int:
        """Nothing is added through this backend (`register` refuses); the cap as given."""
        return cap_bytes or 0

    def generate(
        self, prompt: str, adapter=None, strength: float = 1.0, seed: int = 0, steps: int | None = None, **_
    ) -> Result:
        """POST /generate. Per-step callbacks do not cross the network: progress shows start and end only."""
        answer = self._call("POST", "/generate", json=request_body(prompt, adapter, strength, seed, steps))
        return Result(image=answer_image(answer), info=answer["info"])

    def _get(self, path: str) -> dict[str, Any]:
        return self._call("GET", path)

    def _call(self, method: str, path: str, **kwargs) -> Any:
        """One HTTP call; an error answer ({"error", "field"}) comes back as the error its status stands for
        (`statuses.error_of`), anything else as one line."""
        try:
            r = httpx.request(method, f"{self.url}{path}", timeout=TIMEOUT_S, **kwargs)
        except httpx.HTTPError as e:
            raise LoraManagerError(f"Cannot reach the Ray Serve deployment at {self.url}: {e}") from e
        if r.is_error:
            try:
                error = r.json()
                message, field = str(error["error"]), error.get("field")
            except (ValueError, KeyError, TypeError):
                raise LoraManagerError(f"Ray Serve deployment at {self.url}: HTTP {r.status_code} on {path}.") from None
            raise error_of(r.status_code, message, field)
        return r.json()
