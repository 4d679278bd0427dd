"""The OpenAI wire formats the HTTP server speaks: `GET /v1/models` and `POST /v1/images/generations`, and errors.

Adapters are models, as vLLM and LoRAX name them: `model` is an adapter id (or the base model's id for no adapter),
and each adapter lists the base model as its `parent` and `root`. Several adapters go in the extra field `adapters`
([id, ...] or [[id, strength], ...], as `/generate`'s `adapter`), with `model` left out or the base model's id.
Extra fields (the OpenAI client's `extra_body`): `seed` (image i gets seed + i), `steps`, `strength`,
`guidance_scale`. Pure functions: the ingress (`ray_app.py`) does the I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import NotFoundError, RequestError
from ..request_schema import SEED, GenerateRequest, check_number, check_request, shorten

MAX_IMAGES = 10  # `n`, as OpenAI's own image models allow
GUIDANCE = (0.0, 50.0)
OPENAI_FIELDS = ("model", "prompt", "n", "size", "response_format", "output_format", "user")
EXTRA_FIELDS = ("seed", "steps", "strength", "guidance_scale", "adapters")
SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")


@dataclass(frozen=True)
class Pipeline:
    """What a replica's pipeline accepts, as the ingress checks requests against it."""

    base_model: str  # the base model's id as users know it (`LoraManager.model_name`)
    adapters: tuple[str, ...]
    slots: int
    width: int  # the preset's default size
    height: int
    multiple: int  # sides must be multiples of this (the VAE's scale factor)
    fixed_size: bool  # a compiled denoiser serves its default size only (another would recompile it)
    created: int = 0  # start time, Unix seconds

    @classmethod
    def from_describe(cls, described: dict[str, Any], created: int) -> Pipeline:
        """From a replica's `describe()`."""
        size = described["size"]
        ids = tuple(a["id"] for a in described["adapters"])
        return cls(
            described["base_model"],
            ids,
            described["slots"],
            size["width"],
            size["height"],
            size["multiple"],
            size["fixed"],
            created,
        )


@dataclass(frozen=True)
class ImagesRequest:
    """A checked `/v1/images/generations` request: one engine request per image."""

    request: GenerateRequest
    model: str
    n: int
    width: int
    height: int
    params: dict[str, Any] = field(default_factory=dict)  # pipeline keywords: height, width, guidance_scale

    def bodies(self) -> list[dict[str, Any]]:
        """The replica calls, one per image, seeds seed, seed+1, ..."""
        mix = [list(pair) for pair in self.request.adapters]
        return [
            {
                "prompt": self.request.prompt,
                "adapter": mix,
                "strength": 1.0,
                "seed": self.request.seed + i,
                "steps": self.request.steps,
                "params": self.params,
            }
            for i in range(self.n)
        ]


def error_body(message: str, param: str | None, status: int) -> dict[str, Any]:
    """OpenAI's error object."""
    kind, code = {
        404: ("invalid_request_error", "model_not_found"),
        413: ("invalid_request_error", "request_too_large"),
        429: ("rate_limit_error", "queue_full"),
    }.get(status, ("invalid_request_error" if status < 500 else "server_error", None))
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def models_list(pipe: Pipeline) -> dict[str, Any]:
    """The OpenAI list object: the base model, then every adapter with the base model as parent and root."""
    base = pipe.base_model
    entry = {"object": "model", "created": pipe.created, "owned_by": "lora-hotswap"}
    models = [{"id": base, **entry, "root": base, "parent": None}]
    models += [{"id": a, **entry, "root": base, "parent": base} for a in pipe.adapters]
    return {"object": "list", "data": models}


def parse_images_request(body: dict[str, Any], pipe: Pipeline) -> ImagesRequest:
    """Check every field of a request body against `pipe`; raises RequestError (NotFoundError for `model`)."""
    unknown = sorted(set(body) - set(OPENAI_FIELDS) - set(EXTRA_FIELDS))
    if unknown:
        raise RequestError(
            f"{shorten(unknown[0])} is not supported by this server; the fields are "
            f"{list(OPENAI_FIELDS + EXTRA_FIELDS)}.",
            field=unknown[0][:60],
        )
    if "prompt" not in body:
        raise RequestError("prompt is missing.", field="prompt")
    check_choice("response_format", body.get("response_format"), "b64_json", "url")
    check_choice("output_format", body.get("output_format"), "png")
    n = int(check_number("n", body.get("n", 1), 1, MAX_IMAGES, integer=True))
    width, height = parse_size(body.get("size"), pipe)
    adapter = parse_model(body.get("model"), body.get("adapters"), pipe)
    steps = body.get("steps")
    strength = body.get("strength", 1.0)
    try:
        request = check_request(body["prompt"], adapter, strength, body.get("seed", 0), steps, pipe.slots)
    except RequestError as e:  # the engine's schema names its own field `adapter`
        if e.field == "adapter":
            e.field = "adapters" if "adapters" in body else "model"
        raise
    if request.seed + n - 1 > SEED[1]:
        raise RequestError(f"seed + n - 1 must be at most {SEED[1]} (image i gets seed + i).", field="seed")
    params: dict[str, Any] = {"height": height, "width": width}
    if body.get("guidance_scale") is not None:
        params["guidance_scale"] = float(check_number("guidance_scale", body["guidance_scale"], *GUIDANCE))
    return ImagesRequest(request, body.get("model") or pipe.base_model, n, width, height, params)


def check_choice(name: str, value: Any, accepted: str, refused_with_reason: str | None = None) -> None:
    """`value` is None or `accepted`; `url` gets its own message: this server keeps no images to link to."""
    if value is None or value == accepted:
        return
    if value == refused_with_reason:
        raise RequestError(
            f"{name} 'url' is not served: this server keeps no images to link to; use '{accepted}'.", field=name
        )
    raise RequestError(f"{name} must be {accepted!r}, got {shorten(value)}.", field=name)


def parse_size(size: Any, pipe: Pipeline) -> tuple[int, int]:
    """'WxH' (or None/'auto': the preset's size) as (width, height), within what the pipeline accepts."""
    if size is None or size == "auto":
        return pipe.width, pipe.height
    match = SIZE.fullmatch(size) if isinstance(size, str) else None
    if match is None:
        raise RequestError(
            f"size must be 'WIDTHxHEIGHT' such as '{pipe.width}x{pipe.height}', got {shorten(size)}.", field="size"
        )
    width, height = int(match[1]), int(match[2])
    default = f"{pipe.width}x{pipe.height}"
    if pipe.fixed_size and (width, height) != (pipe.width, pipe.height):
        raise RequestError(
            f"size must be {default!r}: this server's compiled model serves that size only.", field="size"
        )
    largest = 2 * max(pipe.width, pipe.height)
    if not all(pipe.multiple <= side <= largest and side % pipe.multiple == 0 for side in (width, height)):
        raise RequestError(
            f"size {shorten(size)}: each side must be a multiple of {pipe.multiple} between {pipe.multiple} and "
            f"{largest} (this model's default is {default!r}).",
            field="size",
        )
    return width, height


def parse_model(model: Any, adapters: Any, pipe: Pipeline) -> Any:
    """The engine's `adapter` value: None for the base model, an adapter id, or the `adapters` list."""
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model must be a model id (text), got {shorten(model)}.", field="model")
    if adapters is not None:
        if model not in (None, "", pipe.base_model):
            raise RequestError(
                f"with 'adapters', model must be the base model {pipe.base_model!r} or left out.", field="model"
            )
        for entry in adapters if isinstance(adapters, list) else []:
            adapter_id = entry[0] if isinstance(entry, list) and entry else entry
            if isinstance(adapter_id, str) and adapter_id and adapter_id not in pipe.adapters:
                raise NotFoundError(f"The model {shorten(adapter_id)} does not exist (see GET /v1/models).", "adapters")
        return adapters
    if model in (None, "", pipe.base_model):
        return None
    if model not in pipe.adapters:
        raise NotFoundError(f"The model {shorten(model)} does not exist (see GET /v1/models).", field="model")
    return model
