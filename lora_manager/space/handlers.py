"""The Space's actions (generate, add a LoRA, compare, gallery and choices), each a module-level function of the
`Space` it serves, bound to it by `layout.build_demo`; the UI and the API call the same function."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from lora_manager import AdapterInfo, LoraManagerError
from lora_manager.errors import UnknownAdapterError
from lora_manager.request_schema import MAX_ID_CHARS, MAX_PROMPT_CHARS, normalize_mix, shorten
from lora_manager.serving import compare as comparing
from lora_manager.serving.additions import Additions
from lora_manager.serving.protocol import Engine
from lora_manager.space.refusals import Refusal, number_field, refusal, text_field
from lora_manager.space.views import adapter_details, compare_markdown, placeholder_tile

SEED_MAX = 2**32 - 1
COMPARE_MAX = 8  # adapters one comparison runs: one click queues at most twice this many images


@dataclass(frozen=True)
class Space:
    """What the handlers serve: the engine, the adapters visitors added (`Additions`: whose each one is, and their
    budget) and the cap on the size of a file a visitor may add (None: what the engine's template can hold)."""

    engine: Engine
    additions: Additions
    max_adapter_bytes: int | None = None

    def adapters(self, session: str) -> list[AdapterInfo]:
        """The catalog's adapters and the additions this visitor's Gradio session may use, in registration order."""
        return [a for a in self.engine.adapters() if self.additions.may_use(session, a.id)]

    def check_usable(self, session: str, adapter_ids: list[str]) -> None:
        """Refuse an id this visitor may not use: another visitor's addition reads as unknown, as a missing one."""
        visible = [a.id for a in self.adapters(session)]
        for adapter_id in adapter_ids:
            if adapter_id not in visible:
                raise UnknownAdapterError(f"Unknown adapter {shorten(adapter_id)}; available: {visible}.", adapter_id)


def session_of(request: gr.Request | None) -> str:
    """The visitor's Gradio session ("" for a call without one, e.g. from Python)."""
    return getattr(request, "session_hash", None) or ""


def gallery_items(space: Space, request: gr.Request | None = None) -> list[tuple]:
    engine = space.engine
    none = engine.asset_path("previews/none.png")
    items = [(str(none) if none else placeholder_tile("No adapter"), "No adapter")]
    for a in space.adapters(session_of(request)):
        preview = engine.asset_path(a.spec.preview)
        items.append((str(preview) if preview else placeholder_tile(a.spec.display_name), a.spec.display_name))
    return items


AdapterMix = str | list[str | list[str | float]]  # an id, or ids and [id, strength] pairs, one per hotswap slot


def generate(
    space: Space,
    prompt: str,
    adapter: AdapterMix = "",
    strength: float = 1.0,
    seed: int = 0,
    steps: int | None = None,
    request: gr.Request | None = None,
    progress=gr.Progress(),
):
    """Generate one image with a diffusion model and the LoRA adapters chosen for this request.

    Args:
        prompt: what the image shows, in English.
        adapter: '' for none, an adapter id, or a list of ids or [id, strength] pairs to combine, one a slot.
        strength: how strongly each adapter without its own strength applies, -2 to 2 (1 is as trained).
        seed: the random seed, 0 to 4294967295; the same request with the same seed gives the same image.
        steps: denoising steps, 1 to 150; empty for the model's default.
    Returns:
        the image (PNG) and its info: adapters, seed, swap and generation times.
    """
    engine, session = space.engine, session_of(request)
    total = steps if type(steps) is int and steps > 0 else engine.generation_defaults.get("num_inference_steps", 1)

    def on_step(pipe, step, timestep, kwargs):
        progress((step + 1, total), desc="denoising", unit="steps")
        return kwargs

    progress((0, total), desc="swapping adapter", unit="steps")
    try:
        ids = [adapter_id for adapter_id, _ in normalize_mix(adapter, 1.0, engine.max_adapters)]
        space.check_usable(session, ids)
        space.additions.touch(ids)
        result = engine.generate(
            prompt, adapter=adapter, strength=strength, seed=seed, steps=steps, callback_on_step_end=on_step
        )
    except LoraManagerError as e:
        raise refusal(e) from e
    stats = engine.stats()
    held = {a.id: a.bytes for a in space.adapters(session) if a.status != "evicted"}
    cache = {
        "adapters": held,
        "bytes": stats["cache_bytes"],
        "budget_bytes": stats["cache_budget_bytes"],
        "hits": stats["cache_hits"],
        "misses": stats["cache_misses"],
        "evictions": stats["cache_evictions"],
    }
    return result.image, {
        **result.info,
        "swap_ms_median": stats["swap_ms_median"],
        "cpu_cache": cache,
        "compile_source": stats.get("compile_source"),
        "startup_s": engine.startup_s,
    }


def add_adapter(
    space: Space,
    repo_id: str,
    weight_name: str,
    request: gr.Request | None = None,
    progress=gr.Progress(track_tqdm=True),
) -> str:
    """Download a LoRA from the Hub, check it against the loaded template and register it for this visitor (for
    everyone where additions are shared). A file larger than the template can hold (or the server's cap) is refused
    from its declared size, before it is downloaded.

    Args:
        repo_id: the Hub repository of the LoRA, 'owner/name'.
        weight_name: the .safetensors file in it; empty when the repository holds one.
    Returns:
        a status: the id to pass to generate as its adapter, or why the file was refused.
    """
    engine, session = space.engine, session_of(request)
    repo_id = text_field(repo_id, "Hub repo id", MAX_ID_CHARS)
    weight_name = text_field(weight_name, "weight name", MAX_ID_CHARS) or None
    progress(0, desc=f"fetching {repo_id}")
    try:
        space.additions.check_room(session)
        adapter_id = _adapter_id_for(engine, repo_id, weight_name)
        info = engine.register(
            adapter_id,
            repo_id,
            weight_name=weight_name,
            allow_local=False,
            max_bytes=engine.adapter_byte_limit(space.max_adapter_bytes),
        )
        for dropped in space.additions.add(session, adapter_id, max(info.bytes, info.disk_bytes)):
            engine.unregister(dropped)
    except LoraManagerError as e:
        return f"**Refused:** {e}"
    return f"**Added** as `{info.id}`. {adapter_details(info)}  \nPick it in the gallery above."


def _adapter_id_for(engine: Engine, repo_id: str, weight_name: str | None) -> str:
    """A readable id from the repo name (+ file stem); reuses the id of the same source, else adds -2, -3, ..."""
    base = repo_id.rsplit("/", 1)[-1] + (f"-{Path(weight_name).stem}" if weight_name else "")
    base = re.sub(r"[^\w.-]+", "-", base).strip("-.").lower() or "adapter"
    taken = {a.id: (a.source, a.spec.weight_name) for a in engine.adapters()}
    candidate, n = base, 1
    while candidate in taken and taken[candidate] != (repo_id, weight_name):
        n += 1
        candidate = f"{base}-{n}"
    return candidate


def with_triggers(engine: Engine, prompt: str, adapter_ids: list[str]) -> str:
    """`prompt` with each adapter's trigger words appended once (an unknown id adds none: /generate reports it)."""
    for adapter_id in adapter_ids:
        try:
            trigger = engine.spec(adapter_id).trigger
        except LoraManagerError:
            trigger = ""
        if trigger and trigger not in prompt:
            prompt = f"{prompt}, {trigger}" if prompt else trigger
    return prompt


def adapter_choices(space: Space, session: str) -> list[tuple[str, str]]:
    return [("none", "")] + [(a.spec.display_name, a.id) for a in space.adapters(session)]


def select(space: Space, strength: float, evt: gr.SelectData, request: gr.Request | None = None):
    """A gallery click: the adapter's id, its catalog strength and its details (the first tile is no adapter)."""
    adapters = space.adapters(session_of(request))
    index = evt.index if isinstance(evt.index, int) else 0
    a = adapters[index - 1] if 0 < index <= len(adapters) else None
    return (a.id if a else ""), (a.spec.strength if a else strength), adapter_details(a)


def refreshed_choices(space: Space, request: gr.Request | None = None) -> list:
    """The combine rows' dropdowns after an addition: this visitor's adapters."""
    choices = adapter_choices(space, session_of(request))
    return [gr.Dropdown(choices=choices) for _ in range(space.engine.max_adapters - 1)]


def session_closed(space: Space, request: gr.Request | None = None) -> None:
    """A visitor's tab closed: their additions go first when the additions' budget needs room."""
    space.additions.close(session_of(request))


def compare(
    space: Space,
    adapter_ids: list[str],
    prompt: str,
    add_trigger: bool = True,
    seed: int = 0,
    steps: int | None = None,
    request: gr.Request | None = None,
    progress=gr.Progress(),
) -> tuple[list[tuple], str]:
    """The Compare tab: one prompt and seed with each chosen adapter (this visitor's, at most COMPARE_MAX, each at
    its catalog strength and with its trigger when asked) as one mixed batch, then one by one; the batch's images
    captioned with their ids, and both times. Where the engine runs one request per call (max_batch 1, as on ZeroGPU)
    the tab stays: it still shows the adapters side by side, and says the batch ran one per call instead of timing
    the same calls twice. UI only: an API client gets the same from concurrent /generate calls."""
    session = session_of(request)
    ids = _compare_ids(adapter_ids)
    prompt = text_field(prompt, "Prompt", MAX_PROMPT_CHARS)
    seed, steps = round(number_field(seed, "Seed", 0.0)), round(number_field(steps, "Steps", 0.0)) or None
    engine, desc = space.engine, "one mixed batch, then one by one"
    try:
        space.check_usable(session, ids)
        space.additions.touch(ids)
        triggered = {i: with_triggers(engine, prompt, [i]) if add_trigger is True else prompt for i in ids}
        rows = [comparing.Row(i, triggered[i], engine.spec(i).strength) for i in ids]
        done = comparing.compare(engine, rows, seed, steps, lambda n, total: progress((n, total), desc, unit="images"))
    except LoraManagerError as e:
        raise refusal(e) from e
    return [(r.image, i) for r, i in zip(done.results, ids, strict=True)], compare_markdown(done)


def _compare_ids(adapter_ids) -> list[str]:
    """The chosen adapters, each once, refused unless they are 1 to COMPARE_MAX ids."""
    if not isinstance(adapter_ids, list) or not all(isinstance(i, str) for i in adapter_ids):
        raise Refusal(f"adapters must be a list of adapter ids, got {shorten(adapter_ids)}.")
    ids = list(dict.fromkeys(adapter_ids))
    if not 1 <= len(ids) <= COMPARE_MAX:
        raise Refusal(f"Choose 1 to {COMPARE_MAX} adapters to compare, got {len(ids)}.")
    return ids


def compare_choices(space: Space, request: gr.Request | None = None) -> gr.Dropdown:
    """The Compare tab's adapters when it opens: this visitor's (their additions included)."""
    return gr.Dropdown(choices=adapter_choices(space, session_of(request))[1:])
