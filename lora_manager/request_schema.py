"""The one schema of a generation request, shared by every edge: the Python API, the Gradio app and the HTTP server.

Each check runs before the request is queued (nothing is tokenized or swapped for a refused request) and refuses
with a `RequestError` whose message names the field, the value (shortened) and the limit, and whose `field` names
the field for machine clients. Pure functions: no engine state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import RequestError

Mix = tuple[tuple[str, float], ...]  # (adapter id, strength) pairs, in request order; empty for the base model

MAX_PROMPT_CHARS = 2000  # CLIP reads 77 tokens, a few hundred characters; the rest is cut anyway
MAX_ID_CHARS = 200  # adapter ids; Hub repo ids are at most 96 characters a part
MAX_BODY_BYTES = 64 * 1024  # an HTTP request body: the largest valid request is a few kB
STRENGTH = (-2.0, 2.0)
SEED = (0, 2**32 - 1)
STEPS = (1, 150)
FIELDS = ("prompt", "adapter", "strength", "seed", "steps")


@dataclass(frozen=True)
class GenerateRequest:
    """A request that passed every check: what the engine queues."""

    prompt: str
    adapters: Mix
    seed: int
    steps: int | None


def shorten(value: Any, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters: refused values are echoed, never whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"


def check_request(prompt: Any, adapter: Any, strength: Any, seed: Any, steps: Any, slots: int) -> GenerateRequest:
    """Validate one request; `slots` is how many adapters the engine can combine."""
    strength = float(check_number("strength", strength, *STRENGTH))
    return GenerateRequest(
        prompt=check_prompt(prompt),
        adapters=normalize_mix(adapter, strength, slots),
        seed=int(check_number("seed", seed, *SEED, integer=True)),
        steps=None if steps is None else int(check_number("steps", steps, *STEPS, integer=True)),
    )


def check_prompt(prompt: Any) -> str:
    if not isinstance(prompt, str):
        raise RequestError(f"prompt must be text, got {type(prompt).__name__} {shorten(prompt)}.", field="prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise RequestError(
            f"prompt has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS} (the text encoder reads far fewer).",
            field="prompt",
        )
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            f"prompt holds a character that is not valid Unicode text at position {e.start} (a lone surrogate).",
            field="prompt",
        ) from e
    return prompt


def check_number(name: str, value: Any, lo: float, hi: float, integer: bool = False) -> float:
    """A finite real number (an integral one if `integer`) within [lo, hi]; bools and numeric strings are refused."""
    bounds = f"{int(lo)} and {int(hi)}" if integer else f"{lo:g} and {hi:g}"
    rule = f"{name} must be {'an integer' if integer else 'a number'} between {bounds}"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (integer and value != int(value))
        or not lo <= value <= hi
    ):
        raise RequestError(f"{rule}, got {shorten(value)}.", field=name)
    return value


def check_adapter_id(adapter_id: Any) -> str:
    if not isinstance(adapter_id, str):
        raise RequestError(
            f"adapter entries must be an id or an [id, strength] pair, got {shorten(adapter_id)}.", field="adapter"
        )
    if len(adapter_id) > MAX_ID_CHARS:
        raise RequestError(
            f"adapter id has {len(adapter_id)} characters; the limit is {MAX_ID_CHARS} ({shorten(adapter_id)}).",
            field="adapter",
        )
    return adapter_id


def normalize_mix(adapter: Any, strength: float, slots: int) -> Mix:
    """Turn `None`/'' | 'id' | ['id', ...] | [('id', strength), ...] into a Mix; refuse duplicates and overflow."""
    if adapter is None or adapter == "":
        return ()
    if isinstance(adapter, str):
        return ((check_adapter_id(adapter), strength),)
    if not isinstance(adapter, (list, tuple)):
        raise RequestError(
            f"adapter must be an id, a list of ids or of [id, strength] pairs, got {shorten(adapter)}.",
            field="adapter",
        )
    if len(adapter) > max(slots, 1) * 4:  # blank rows are allowed, a flood is not
        raise RequestError(
            f"adapter has {len(adapter)} entries; this engine combines at most {slots}.", field="adapter"
        )
    mix = []
    for entry in adapter:
        if isinstance(entry, (list, tuple)) and len(entry) == 2:
            mix.append((check_adapter_id(entry[0]), float(check_number("strength", entry[1], *STRENGTH))))
        elif isinstance(entry, str):
            mix.append((check_adapter_id(entry), strength))
        else:
            check_adapter_id(entry)  # refuses it, naming the forms accepted
    mix = [(i, s) for i, s in mix if i]  # an empty id is an unused slot (the app's blank rows)
    ids = [i for i, _ in mix]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise RequestError(
            f"Adapter {shorten(dupes[0])} appears twice in one request; give it once with its strength.",
            field="adapter",
        )
    if len(mix) > slots:
        raise RequestError(
            f"{len(mix)} adapters requested but this engine has {slots} hotswap slot(s); "
            f"start it with slots={len(mix)} (app: --slots {len(mix)}).",
            field="adapter",
        )
    return tuple(mix)
