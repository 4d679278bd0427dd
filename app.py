"""Gradio Space for lora_manager: one pipeline, many LoRAs chosen per request, hotswapped without recompiling.

    python app.py [--preset tiny|sd15|sdxl|flux|path.json] [--dtype float16|bfloat16|float32]
                  [--compile/--no-compile] [--target-rank N] [--cache-mb N] [--slots K] [--max-batch B]
                  [--aot-package FILE] [--backend local|ray --ray-url URL] [--host 127.0.0.1] [--port 7860]
                  [--share]

Env fallbacks: LORA_PRESET, LORA_DTYPE, LORA_COMPILE (1/0; unset = on for CUDA only), LORA_SLOTS, LORA_MAX_BATCH,
GRADIO_SERVER_NAME, GRADIO_SERVER_PORT. The UI and the API share one function per action: `/generate` (prompt,
adapter, strength, seed, steps) -> (image, info), where adapter is '' (none), an id, or a list of ids or [id, strength]
pairs (up to K), and `/add_adapter` (repo_id, weight_name) -> status. All logic lives in lora_manager; this file only
wires it.
"""

from __future__ import annotations

import os

# ZeroGPU (the `spaces` package with SPACES_ZERO_GPU=true): a GPU is attached only inside functions decorated with
# spaces.GPU, which run in a process forked from this one. `spaces` refuses to start once CUDA is initialized, and
# importing diffusers initializes it, so `spaces` comes first. transformers loads weights in worker threads, where
# spaces' CUDA placeholders do not reach: loads run on this thread instead.
if os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true"):
    os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")
try:
    import spaces
except ImportError:  # not on a Space: GPU functions run as they are
    spaces = None

import argparse
import functools
import inspect
import json
import logging
import math
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import psutil
from fastapi.exceptions import RequestValidationError
from gradio.components.api_component import Api
from gradio.utils import get_function_params
from gradio_client.utils import python_type_to_json_schema
from PIL import Image, ImageDraw
from starlette.middleware import Middleware
from starlette.responses import JSONResponse

import lora_manager
from lora_manager import AdapterInfo, LoraManager, LoraManagerError
from lora_manager.errors import EngineClosedError, QueueFullError, UnknownAdapterError
from lora_manager.request_schema import MAX_ID_CHARS, MAX_PROMPT_CHARS, normalize_mix, shorten
from lora_manager.serving import compare as comparing
from lora_manager.serving.additions import Additions
from lora_manager.serving.protocol import Engine
from lora_manager.serving.remote import RemoteManager
from lora_manager.specs import DTYPE_NAMES

ZERO_GPU = os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")
STARTED = psutil.Process().create_time()  # "ready in" counts from the process start, the imports included


def gpu(fn: Callable) -> Callable:
    """`fn` as a ZeroGPU function where `spaces` is installed (it runs as it is elsewhere)."""
    return spaces.GPU(fn) if spaces is not None else fn


PRESETS = Path(lora_manager.__file__).parent / "presets"
GPU_PRESETS = ("sd15", "sdxl", "flux")  # the order a GPU default is picked in: flux, gated, last

log = logging.getLogger("app")
SEED_MAX = 2**32 - 1
MAX_UPLOAD = "1kb"  # the app has no file input: Gradio's upload route gets nothing bigger than this
STRATEGIES_TIMEOUT_S = 600
_STRATEGIES_LOCK = threading.Lock()  # one measurement at a time, in a process of its own
# Gradio lets this many generate calls reach the engine at once; its scheduler runs one at a time, grouped by adapter,
# and answers "Busy ... retry" when its own queue is full.
GENERATE_CONCURRENCY = 8
COMPARE_MAX = 8  # adapters one comparison runs: one click queues at most twice this many images
ZERO_GPU_NOTE = (
    "On ZeroGPU the engine runs eager (torch.compile is unavailable there) and one request per pipeline "
    "call: the move to the GPU worker splits the stacked adapter tensors that mixed batches share."
)
CSS = """
#gallery .thumbnail-item img, #compare-gallery .thumbnail-item img, #output-image img { image-rendering: pixelated; }
#output-image img { width: 100%; height: 100%; object-fit: contain; }
#gallery .grid-wrap.fixed-height { min-height: 0; }
#info-panel { min-height: 7em; }
"""


# ---- refusals: what the caller sent, told apart from a failure of the server ----------------------------------------

# Gradio's direct route (/gradio_api/run/...) answers every error with HTTP 500; a Refusal gets its status by title
REFUSAL_STATUS = {"Invalid request": 422, "Busy": 429}


class Refusal(gr.Error):
    """A request refused for what it asks, with a message that says what to send or when to retry (a 4xx on Gradio's
    direct route, an error event on its queue, a modal in the UI)."""

    def __init__(self, message: str, title: str = "Invalid request"):
        super().__init__(message, title=title, print_exception=False)


def refusal(error: LoraManagerError) -> gr.Error:
    """The engine's refusal as the caller sees it: a full queue is busy, a closed engine a failure of the server."""
    if isinstance(error, EngineClosedError):
        return gr.Error(str(error))
    return Refusal(str(error), "Busy" if isinstance(error, QueueFullError) else "Invalid request")


class RefusalStatus:
    """ASGI middleware: on Gradio's direct route, a 500 whose JSON body is a Refusal takes the refusal's 4xx status."""

    DIRECT = ("/gradio_api/run/", "/gradio_api/api/")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(self.DIRECT):
            return await self.app(scope, receive, send)
        held: list[dict] = []  # a 500's start and body, until the whole body is read

        async def relay(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] == 500:
                held.append(message)
            elif not held:
                await send(message)
            else:
                held.append(message)
                if not message.get("more_body"):
                    body = b"".join(m.get("body", b"") for m in held[1:])
                    await send({**held[0], "status": _refusal_status(body)})
                    await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, relay)


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


# ---- presentation helpers (no engine logic) -------------------------------------------------------------------------


def _mb(nbytes: int | None) -> str:
    return f"{(nbytes or 0) / 2**20:.1f} MB"


def _placeholder(text: str) -> Image.Image:
    """A neutral tile for adapters that have no preview image (e.g. added from the Hub)."""
    img = Image.new("RGB", (128, 128), (226, 232, 240))
    ImageDraw.Draw(img).text((64, 64), text[:14], fill=(51, 65, 85), anchor="mm")
    return img


def _details(a: AdapterInfo | None) -> str:
    if a is None:
        return "**No adapter**: the base model alone."
    s = a.spec
    lines = [
        f"**{s.display_name}** (`{a.id}`): rank {a.rank}, alpha {a.alpha:g}, {a.num_modules} modules"
        + (" incl. text encoder" if a.has_text_encoder else "")
        + f", {a.format} format, {_mb(a.bytes)}"
    ]
    if s.trigger:
        lines.append(f"trigger: `{s.trigger}`")
    if s.license:
        lines.append(f"license: {s.license}")
    if s.description:
        lines.append(s.description)
    return "  \n".join(lines)


def _adapters_text(info: dict) -> str:
    adapter, strength = info["adapter"], info["strength"]
    if not adapter:
        return "none"
    if isinstance(adapter, list):
        return " + ".join(f"{a} at strength {s:g}" for a, s in zip(adapter, strength, strict=True))
    return f"{adapter} at strength {strength:g}"


def info_markdown(info: dict | None) -> str:
    """The human view of the info dict that /generate returns (anything else shows the placeholder)."""
    if isinstance(info, dict) and info:
        try:
            return _info_lines(info)
        except (KeyError, TypeError, ValueError, AttributeError):  # not an info dict of /generate
            pass
    return "*Generate an image to see swap and generation times.*"


def _info_lines(info: dict) -> str:
    cache = info.get("cpu_cache", {})
    held = ", ".join(f"`{k}` {_mb(v)}" for k, v in cache.get("adapters", {}).items()) or "none"
    return "  \n".join(
        [
            f"**adapter:** {_adapters_text(info)} · seed {info['seed']}",
            f"**prompt:** {info['prompt']}"
            + (" *(longer than the text encoder reads: the end was cut off)*" if info.get("prompt_truncated") else ""),
            f"**swap:** {info['swap_ms']:.1f} ms · **generation:** {info['generate_ms'] / 1e3:.2f} s "
            f"({info.get('num_inference_steps', '?')} steps)",
            f"**compiled:** {info.get('compile_source', 'yes') if info['compiled'] else 'no (eager)'} · "
            f"**dtype:** {info.get('dtype', '?')} · **recompiles: {info['recompiles']}** since start",
            f"**CPU cache:** {len(cache.get('adapters', {}))} adapters, {_mb(cache.get('bytes'))} of "
            f"{_mb(cache.get('budget_bytes'))}: {held}",
            f"**start-up:** {_phases(info.get('startup_s') or {}) or 'not measured'}",
        ]
    )


def _phases(startup_s: dict[str, float]) -> str:
    return ", ".join(f"{name.replace('_', ' ')} {s:.1f} s" for name, s in startup_s.items())


def _text(value, name: str, limit: int) -> str:
    """A UI field as stripped text, refused with the field's name when it is not text or too long."""
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > limit:
        raise Refusal(f"{name} must be text of at most {limit} characters, got {shorten(value)}.")
    return value.strip()


def _float(value, name: str, default: float) -> float:
    """A UI number as a finite float (`default` when empty), refused with the field's name otherwise."""
    try:
        number = float(value) if value is not None else default
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise Refusal(f"{name} must be a number, got {shorten(value)}.")
    return number


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


# ---- handlers: module-level functions of the Space, bound to it by build_demo --------------------------------------


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


def _session(request: gr.Request | None) -> str:
    """The visitor's Gradio session ("" for a call without one, e.g. from Python)."""
    return getattr(request, "session_hash", None) or ""


def gallery_items(space: Space, request: gr.Request | None = None) -> list[tuple]:
    engine = space.engine
    none = engine.asset_path("previews/none.png")
    items = [(str(none) if none else _placeholder("No adapter"), "No adapter")]
    for a in space.adapters(_session(request)):
        preview = engine.asset_path(a.spec.preview)
        items.append((str(preview) if preview else _placeholder(a.spec.display_name), a.spec.display_name))
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
    engine, session = space.engine, _session(request)
    total = steps if type(steps) is int and steps > 0 else engine.generation_defaults.get("num_inference_steps", 1)

    def on_step(pipe, step, timestep, kwargs):
        progress((step + 1, total), desc="denoising", unit="steps")
        return kwargs

    progress((0, total), desc="swapping adapter", unit="steps")
    try:
        ids = [adapter_id for adapter_id, _ in normalize_mix(adapter, 1.0, engine.max_adapters)]
        visible = [a.id for a in space.adapters(session)]
        for adapter_id in ids:
            if adapter_id not in visible:
                raise UnknownAdapterError(f"Unknown adapter {shorten(adapter_id)}; available: {visible}.", adapter_id)
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
    engine, session = space.engine, _session(request)
    repo_id = _text(repo_id, "Hub repo id", MAX_ID_CHARS)
    weight_name = _text(weight_name, "weight name", MAX_ID_CHARS) or None
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
        for dropped in space.additions.add(session, adapter_id, info.bytes):
            engine.unregister(dropped)
    except LoraManagerError as e:
        return f"**Refused:** {e}"
    return f"**Added** as `{info.id}`. {_details(info)}  \nPick it in the gallery above."


@dataclass(frozen=True)
class GenerateForm:
    """The Generate tab's components that the Generate button reads (the request) and writes (the result)."""

    prompt: gr.Textbox
    adapter_id: gr.Textbox
    strength: gr.Slider
    add_trigger: gr.Checkbox
    seed: gr.Number
    randomize: gr.Checkbox
    steps: gr.Slider
    extra: tuple[tuple[gr.Dropdown, gr.Slider], ...]  # the combine rows: adapter and strength per further slot
    image: gr.Image
    info: gr.JSON
    panel: gr.Markdown

    @property
    def inputs(self) -> set:
        fields = (self.prompt, self.adapter_id, self.strength, self.add_trigger, self.seed, self.randomize, self.steps)
        return {*fields, *(c for row in self.extra for c in row)}

    @property
    def outputs(self) -> list:
        return [self.image, self.info, self.seed, self.panel]


def request_of(space: Space, form: GenerateForm, values: dict) -> dict:
    """The form's values as /generate's named arguments: the adapters ([id, strength] per filled slot), the prompt
    (their triggers appended when asked), strength, seed (fresh when randomize is on) and steps. It refuses what is
    not text or a number, naming the field; /generate checks the ranges."""
    prompt = _text(values[form.prompt], "Prompt", MAX_PROMPT_CHARS)
    strength = _float(values[form.strength], "Strength", 1.0)
    rows = [(values[form.adapter_id], strength)] + [(values[a], values[s]) for a, s in form.extra]
    mix = [[_text(i, "adapter", MAX_ID_CHARS), _float(s, "strength", strength)] for i, s in rows if i]
    if values[form.add_trigger] is True:
        prompt = _with_triggers(space.engine, prompt, [i for i, _ in mix])
    randomize = values[form.randomize] is True
    seed = random.randint(0, SEED_MAX) if randomize else round(_float(values[form.seed], "Seed", 0.0))
    steps = round(_float(values[form.steps], "Steps", 0.0)) or None
    return {"prompt": prompt, "adapter": mix, "strength": strength, "seed": seed, "steps": steps}


def _with_triggers(engine: Engine, prompt: str, adapter_ids: list[str]) -> str:
    """`prompt` with each adapter's trigger words appended once (an unknown id adds none: /generate reports it)."""
    for adapter_id in adapter_ids:
        try:
            trigger = engine.spec(adapter_id).trigger
        except LoraManagerError:
            trigger = ""
        if trigger and trigger not in prompt:
            prompt = f"{prompt}, {trigger}" if prompt else trigger
    return prompt


def generate_from_form(
    space: Space,
    form: GenerateForm,
    run: Callable,
    values: dict,
    request: gr.Request | None = None,
    progress=gr.Progress(),
) -> dict:
    """The Generate button: the form's request through `run` (/generate's function); the image, its info, the seed
    used and the info panel, keyed by component."""
    sent = request_of(space, form, values)
    image, info = run(**sent, request=request, progress=progress)
    return {form.image: image, form.info: info, form.seed: sent["seed"], form.panel: info_markdown(info)}


def adapter_choices(space: Space, session: str) -> list[tuple[str, str]]:
    return [("none", "")] + [(a.spec.display_name, a.id) for a in space.adapters(session)]


def select(space: Space, strength: float, evt: gr.SelectData, request: gr.Request | None = None):
    """A gallery click: the adapter's id, its catalog strength and its details (the first tile is no adapter)."""
    adapters = space.adapters(_session(request))
    index = evt.index if isinstance(evt.index, int) else 0
    a = adapters[index - 1] if 0 < index <= len(adapters) else None
    return (a.id if a else ""), (a.spec.strength if a else strength), _details(a)


def refreshed_choices(space: Space, request: gr.Request | None = None) -> list:
    """The combine rows' dropdowns after an addition: this visitor's adapters."""
    choices = adapter_choices(space, _session(request))
    return [gr.Dropdown(choices=choices) for _ in range(space.engine.max_adapters - 1)]


def session_closed(space: Space, request: gr.Request | None = None) -> None:
    """A visitor's tab closed: their additions go first when the additions' budget needs room."""
    space.additions.close(_session(request))


def strategies(repeats: int, progress=gr.Progress()):
    """Time every way of switching adapters on fresh copies of the embedded model, in a process of its own (one
    torch thread; never the live pipeline), one measurement at a time: a second caller is told to retry.

    Args:
        repeats: measurements per strategy, 2 to 20; the median is reported.
    Returns:
        the chart, a table of median milliseconds per switch, and the full report.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, (int, float)) or not 2 <= repeats <= 20:
        raise Refusal(f"repeats must be a number between 2 and 20, got {shorten(repeats)}.")
    if not _STRATEGIES_LOCK.acquire(blocking=False):
        raise Refusal("A measurement is already running; retry in a minute, when it has finished.", title="Busy")
    try:
        progress(0, desc="measuring reload, set_adapters, diffusers hotswap and the engine's swap")
        report = _run_bench(int(repeats))
        from lora_manager.bench import bench  # matplotlib: loaded when the tab is used, not at start-up

        floor = report["results"]["floor_per_tensor_ms"]
        rows = [[k.removesuffix("_ms"), round(v, 3), round(v / floor, 2)] for k, v in report["results"].items()]
        return bench.make_figure(report), rows, report
    finally:
        _STRATEGIES_LOCK.release()


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
    ids = _compare_ids(space, adapter_ids, _session(request))
    prompt = _text(prompt, "Prompt", MAX_PROMPT_CHARS)
    seed, steps = round(_float(seed, "Seed", 0.0)), round(_float(steps, "Steps", 0.0)) or None
    engine, desc = space.engine, "one mixed batch, then one by one"
    space.additions.touch(ids)
    try:
        triggered = {i: _with_triggers(engine, prompt, [i]) if add_trigger is True else prompt for i in ids}
        rows = [comparing.Row(i, triggered[i], engine.spec(i).strength) for i in ids]
        done = comparing.compare(engine, rows, seed, steps, lambda n, total: progress((n, total), desc, unit="images"))
    except LoraManagerError as e:
        raise refusal(e) from e
    return [(r.image, i) for r, i in zip(done.results, ids, strict=True)], compare_markdown(done)


def _compare_ids(space: Space, adapter_ids, session: str) -> list[str]:
    """The chosen adapters, each once, refused unless they are 1 to COMPARE_MAX of this visitor's."""
    if not isinstance(adapter_ids, list) or not all(isinstance(i, str) for i in adapter_ids):
        raise Refusal(f"adapters must be a list of adapter ids, got {shorten(adapter_ids)}.")
    ids, visible = list(dict.fromkeys(adapter_ids)), [a.id for a in space.adapters(session)]
    if not 1 <= len(ids) <= COMPARE_MAX:
        raise Refusal(f"Choose 1 to {COMPARE_MAX} adapters to compare, got {len(ids)}.")
    for adapter_id in ids:
        if adapter_id not in visible:
            raise Refusal(f"Unknown adapter {shorten(adapter_id)}; available: {visible}.")
    return ids


def compare_markdown(done: comparing.Comparison) -> str:
    """The Compare tab's timing line: the batch's time, pipeline calls and the steps they ran beside one by one's, and
    the speed-up."""
    n, calls = len(done.results), f"{done.batch_calls} pipeline call{'s' * (done.batch_calls != 1)}"
    steps = done.results[0].info.get("num_inference_steps", "?")  # as the engine ran them, its default included
    batch = f"**one mixed batch:** {done.batch_s:.2f} s ({calls} for {n} image{'s' * (n != 1)}, {steps} steps each)"
    if done.solo_s is None:
        return (
            f"{batch}. This engine runs one request per pipeline call (max_batch 1, as on ZeroGPU): one by one would "
            "run the same calls, so they are not timed twice."
        )
    return (
        f"{batch} · **one by one:** {done.solo_s:.2f} s ({n} calls) · **{done.speedup:.1f}× as fast** batched; "
        f"every batch image equals its one-by-one image within {done.max_levels} of 255 levels"
    )


def compare_choices(space: Space, request: gr.Request | None = None) -> gr.Dropdown:
    """The Compare tab's adapters when it opens: this visitor's (their additions included)."""
    return gr.Dropdown(choices=adapter_choices(space, _session(request))[1:])


def _bind(fn: Callable, *bound) -> Callable:
    """`fn` with its first arguments (the Space, ...) filled in, as Gradio should see it: the same name, docstring
    and parameters (minus those), so its API page, `gr.Progress`, `gr.Request` and `gr.SelectData` work as for a
    plain function."""

    @functools.wraps(fn)
    def bound_fn(*args, **kwargs):
        return fn(*bound, *args, **kwargs)

    signature = inspect.signature(fn)
    bound_fn.__signature__ = signature.replace(parameters=list(signature.parameters.values())[len(bound) :])
    return bound_fn


def _api_inputs(fn: Callable) -> list[Api]:
    """An API-only input for each typed parameter of `fn`, typed from its hints as `gr.api` does: values arrive
    unconverted, so the request schema (not a component's converter) checks them and names the field it refuses."""
    return [
        Api(default if has_default else None, python_type_to_json_schema(hint), name)
        for name, has_default, default, hint in get_function_params(fn)
        if hint is not None
    ]


# ---- layout ---------------------------------------------------------------------------------------------------------


def _slider_steps(engine: Engine) -> int:
    """A steps slider's starting value: the preset's default steps, else 20."""
    return int(engine.generation_defaults.get("num_inference_steps", 20))


def _header(engine: Engine) -> str:
    combine = engine.max_adapters > 1
    return (
        "# LoRA hotswap\n"
        f"One `{engine.model_name}` pipeline serves every LoRA below. Each request carries its own adapter "
        "and strength; the engine copies that adapter's weights in place into a fixed-rank template "
        f"(rank {engine.target_rank}), so the model is never reloaded and a compiled model is never recompiled: "
        "watch `recompiles` in the info panel. Adapters wait in a CPU-memory cache."
        + (f" Up to {engine.max_adapters} LoRAs combine in one request (one hotswap slot each)." if combine else "")
        + "\n\n"
        f"*{engine.catalog.description}*" + (f"\n\n> {ZERO_GPU_NOTE}" if ZERO_GPU else "")
    )


def _generate_tab(demo: gr.Blocks, space: Space) -> None:
    """The Generate tab and its events: gallery, prompt and settings, image and info, and "Add a LoRA"."""
    with gr.Row():
        with gr.Column(scale=3):
            gallery, (details, fields) = _gallery(demo, space), _request_fields(space)
            run = gr.Button("Generate", variant="primary", elem_id="generate")
        with gr.Column(scale=2):
            image = gr.Image(
                label="Image", type="pil", format="png", interactive=False, height=384, elem_id="output-image"
            )
            panel = gr.Markdown(info_markdown(None), elem_id="info-panel")
            with gr.Accordion("Full info (JSON)", open=False):
                info = gr.JSON(label="info")
    form = GenerateForm(**fields, image=image, info=info, panel=panel)
    gallery.select(
        _bind(select, space), form.strength, [form.adapter_id, form.strength, details], api_visibility="private"
    )
    _generate_events(space, form, run)
    _add_box(space, gallery, form)


def _gallery(demo: gr.Blocks, space: Space) -> gr.Gallery:
    """The adapters as tiles (the first is no adapter), this visitor's when the page loads; a closed page lets the
    visitor's additions go first."""
    gallery = gr.Gallery(
        label="Adapters (click to select)",
        columns=4,
        height="auto",
        allow_preview=False,
        object_fit="contain",
        selected_index=0,
        elem_id="gallery",
        format="png",
        interactive=False,
        buttons=[],
    )
    demo.load(_bind(gallery_items, space), None, gallery, api_visibility="private", queue=False, show_progress="hidden")
    demo.unload(_bind(session_closed, space))
    return gallery


def _request_fields(space: Space) -> tuple[gr.Markdown, dict]:
    """The request's inputs below the gallery: adapter, combine rows, prompt, strength, steps and seed."""
    engine = space.engine
    with gr.Row():
        adapter_id = gr.Textbox(
            "", label="adapter_id", placeholder="(none)", interactive=False, scale=1, elem_id="adapter-id"
        )
        details = gr.Markdown(_details(None), elem_id="adapter-details")
    extra = []
    with gr.Accordion(
        f"Combine LoRAs (up to {engine.max_adapters})", open=False, visible=engine.max_adapters > 1, elem_id="combine"
    ):
        for k in range(2, engine.max_adapters + 1):
            with gr.Row():
                choice = gr.Dropdown(adapter_choices(space, ""), value="", label=f"adapter {k}", elem_id=f"adapter-{k}")
                extra.append((choice, gr.Slider(0, 2, 1.0, step=0.05, label=f"strength {k}")))
    prompt = gr.Textbox("a red circle on a blue background", label="Prompt", lines=2, elem_id="prompt")
    add_trigger = gr.Checkbox(True, label="add trigger words")
    with gr.Row():
        strength = gr.Slider(0, 2, 1.0, step=0.05, label="Strength")
        steps = gr.Slider(1, 50, _slider_steps(engine), step=1, label="Steps")
    with gr.Row():
        seed = gr.Number(0, label="Seed", precision=0, minimum=0, maximum=SEED_MAX)
        randomize = gr.Checkbox(False, label="randomize")
    fields = dict(prompt=prompt, adapter_id=adapter_id, strength=strength, add_trigger=add_trigger, seed=seed)
    return details, {**fields, "randomize": randomize, "steps": steps, "extra": tuple(extra)}


def _generate_events(space: Space, form: GenerateForm, run: gr.Button) -> None:
    """/generate for API and MCP clients (typed, API-only inputs) and the Generate button (the form), one function
    behind both, sharing one concurrency limit."""
    # ZeroGPU pickles a GPU function's arguments into its worker: the Space is bound before `gpu`, not passed
    generate_fn = gpu(_bind(generate, space))
    adapters = ", ".join(f"{a.id} ({a.spec.display_name})" for a in space.engine.adapters())
    gr.on(
        [],
        generate_fn,
        _api_inputs(_bind(generate, space)),
        [form.image, form.info],
        api_name="generate",
        api_description=f"{inspect.getdoc(generate).splitlines()[0]} Adapters: {adapters or 'none'}.",
        concurrency_limit=GENERATE_CONCURRENCY,
        concurrency_id="generate",
    )
    run.click(
        _bind(generate_from_form, space, form, generate_fn),
        form.inputs,
        form.outputs,
        api_visibility="private",
        concurrency_limit=GENERATE_CONCURRENCY,
        concurrency_id="generate",
    )


def _add_box(space: Space, gallery: gr.Gallery, form: GenerateForm) -> None:
    """ "Add a LoRA from the Hub": /add_adapter, then this visitor's gallery and combine choices refreshed."""
    with gr.Accordion("Add a LoRA from the Hub", open=False, elem_id="add-box"):
        with gr.Row():
            repo_id = gr.Textbox("", label="Hub repo id", placeholder="owner/name", elem_id="repo-id")
            weight_name = gr.Textbox("", label="weight name (optional)", placeholder="lora.safetensors")
        add = gr.Button("Add", elem_id="add")
        status = gr.Markdown(label="status", elem_id="add-status")
    added = add.click(_bind(add_adapter, space), [repo_id, weight_name], status, api_name="add_adapter")
    added.then(
        _bind(gallery_items, space), None, gallery, api_visibility="private", queue=False, show_progress="hidden"
    )
    if form.extra:
        added.then(
            _bind(refreshed_choices, space),
            None,
            [dropdown for dropdown, _ in form.extra],
            api_visibility="private",
            queue=False,
            show_progress="hidden",
        )


def _strategies_tab() -> None:
    gr.Markdown(
        "Every way of switching adapters side by side, measured now on fresh copies of the embedded tiny model "
        "(the live pipeline is not touched): reload per request, every adapter resident with "
        "`set_adapters` (forward cost against the number resident), diffusers' `hotswap=True`, and this "
        "engine's in-place swap, against the floor of copying the same bytes. "
        "`python -m lora_manager bench --scale sdxl` runs the same at SDXL size."
    )
    with gr.Row():
        repeats = gr.Slider(2, 20, 3, step=1, label="repeats (median of)")
        measure = gr.Button("Measure", variant="primary", elem_id="measure")
    plot = gr.Plot(label="switch latency and resident-adapter cost")
    table = gr.Dataframe(headers=["strategy", "ms", "x floor"], label="median ms per switch")
    with gr.Accordion("Full report (JSON)", open=False):
        report = gr.JSON()
    measure.click(strategies, repeats, [plot, table, report], api_name="strategies")


def _compare_tab(space: Space) -> None:
    """One prompt and seed with many adapters as one mixed batch beside one by one (`compare`), one run at a time."""
    engine = space.engine
    choices = adapter_choices(space, "")[1:]
    with gr.Tab("Compare") as tab:
        gr.Markdown(
            "One prompt and seed with each adapter chosen below, sent at once: the engine runs requests with the same "
            "settings together, each row of a pipeline call with its own LoRA. Then the same images one by one."
        )
        adapters = gr.Dropdown(
            choices,
            value=[i for _, i in choices[:COMPARE_MAX]],
            multiselect=True,
            max_choices=COMPARE_MAX,
            label=f"adapters (up to {COMPARE_MAX})",
            elem_id="compare-adapters",
        )
        prompt = gr.Textbox("a red circle on a blue background", label="Prompt", elem_id="compare-prompt")
        with gr.Row():
            add_trigger = gr.Checkbox(True, label="add trigger words")
            seed = gr.Number(0, label="Seed", precision=0, minimum=0, maximum=SEED_MAX)
            steps = gr.Slider(1, 50, _slider_steps(engine), step=1, label="Steps", elem_id="compare-steps")
        run = gr.Button("Compare", variant="primary", elem_id="compare-run")
        timing = gr.Markdown("*Run to see the batch's time beside one by one's.*", elem_id="compare-timing")
        gallery = gr.Gallery(label="one mixed batch", columns=4, height="auto", format="png", elem_id="compare-gallery")
    tab.select(_bind(compare_choices, space), None, adapters, api_visibility="private", queue=False)
    run.click(
        gpu(_bind(compare, space)),
        [adapters, prompt, add_trigger, seed, steps],
        [gallery, timing],
        api_visibility="private",
        concurrency_limit=1,
        concurrency_id="compare",
    )


def build_demo(engine: Engine, additions: Additions | None = None, max_adapter_bytes: int | None = None) -> gr.Blocks:
    """The Blocks app over `engine` (`LoraManager` in-process or `RemoteManager`), with visitors' additions kept by
    `additions` (default: per visitor, `Additions()`'s limits) and capped at `max_adapter_bytes` a file; the caller
    queues and launches."""
    space = Space(engine, additions or Additions(), max_adapter_bytes)
    with gr.Blocks(title="LoRA hotswap") as demo:
        gr.Markdown(_header(engine))
        with gr.Tab("Generate"):
            _generate_tab(demo, space)
        _compare_tab(space)
        with gr.Tab("Strategies"):
            _strategies_tab()
    return demo


def _run_bench(repeats: int) -> dict:
    """`python -m lora_manager bench` in a child process: its models, memory and threads never touch the server's."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "lora_manager",
            "bench",
            "--scale",
            "tiny",
            "--repeats",
            str(repeats),
            "--device",
            "cpu",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=STRATEGIES_TIMEOUT_S, cwd=Path(__file__).parent
            )
        except subprocess.TimeoutExpired as e:
            raise gr.Error(f"The measurement took longer than {STRATEGIES_TIMEOUT_S} s and was stopped.") from e
        if done.returncode != 0 or not out.is_file():
            log.error("bench failed (%s): %s", done.returncode, done.stderr[-2000:])
            raise gr.Error("The measurement failed; the server log has the details.")
        return json.loads(out.read_text())


# ---- command line ---------------------------------------------------------------------------------------------------


def _env_bool(name: str) -> bool | None:
    value = os.environ.get(name, "").strip().lower()
    return None if value in ("", "auto") else value in ("1", "true", "yes", "on")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _model_args(p)
    _visitor_args(p)
    p.add_argument(
        "--backend",
        choices=("local", "ray"),
        default=os.environ.get("LORA_BACKEND", "local"),
        help="local: the engine in this process; ray: a `python -m lora_manager serve` deployment",
    )
    p.add_argument(
        "--ray-url",
        default=os.environ.get("LORA_RAY_URL", "http://127.0.0.1:8000"),
        help="the Ray Serve deployment's HTTP address (with --backend ray)",
    )
    p.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    p.add_argument("--share", action="store_true")
    return p.parse_args(argv)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default=os.environ.get("LORA_PRESET") or None,
        help="tiny, sd15, sdxl, flux or a catalog .json path (env LORA_PRESET; default: with CUDA the preset for the "
        "README's suggested_hardware, else tiny)",
    )
    p.add_argument(
        "--dtype",
        default=os.environ.get("LORA_DTYPE") or None,
        choices=DTYPE_NAMES,
        help="the pipeline's dtype (env LORA_DTYPE; default: the preset's on CUDA, float32 on the CPU)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("LORA_COMPILE"),
        help="torch.compile the denoiser (env LORA_COMPILE; default on for CUDA, never on ZeroGPU)",
    )
    p.add_argument(
        "--aot-package",
        default=os.environ.get("LORA_AOT_PACKAGE") or None,
        help="run the denoiser from this AOTInductor package (`python -m lora_manager aot-package`) "
        "instead of compiling; needs --max-batch 1 --slots 1 (env LORA_AOT_PACKAGE)",
    )
    p.add_argument("--target-rank", type=int, default=None, help="hotswap template rank (default: largest in catalog)")
    p.add_argument("--cache-mb", type=int, default=None, help="CPU adapter cache budget in MiB (default 4096)")
    p.add_argument(
        "--slots",
        type=int,
        default=int(os.environ.get("LORA_SLOTS", 2)),
        help="hotswap slots: LoRAs one request can combine (env LORA_SLOTS; default 2)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=int(os.environ.get("LORA_MAX_BATCH", 4)),
        help="requests run in one pipeline call, whatever their LoRAs (env LORA_MAX_BATCH; default 4)",
    )


def _visitor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-adapter-mb",
        type=int,
        default=_env_int("LORA_MAX_ADAPTER_MB"),
        help="largest LoRA file a visitor may add, MiB (env LORA_MAX_ADAPTER_MB; default: what the template can hold)",
    )
    p.add_argument(
        "--additions-per-visitor",
        type=int,
        default=_env_int("LORA_ADDITIONS_PER_VISITOR") or 4,
        help="LoRAs one visitor may add (env LORA_ADDITIONS_PER_VISITOR; default 4)",
    )
    p.add_argument(
        "--max-additions",
        type=int,
        default=_env_int("LORA_MAX_ADDITIONS") or 16,
        help="visitors' additions kept in all; the least recently used go first (env LORA_MAX_ADDITIONS)",
    )
    p.add_argument(
        "--additions-mb",
        type=int,
        default=_env_int("LORA_ADDITIONS_MB") or 2048,
        help="MiB all visitors' additions may hold, in memory and on disk (env LORA_ADDITIONS_MB)",
    )
    p.add_argument(
        "--shared-additions",
        action=argparse.BooleanOptionalAction,
        default=bool(_env_bool("LORA_SHARED_ADDITIONS")),
        help="every visitor sees every addition (env LORA_SHARED_ADDITIONS=1; default: per visitor)",
    )


@dataclass(frozen=True)
class PresetChoice:
    """The preset the app runs and why, for the ready line."""

    preset: str
    reason: str


def choose_preset(
    requested: str | None, cuda_available: bool, hardware: str | None, preset_hardware: dict[str, str | None]
) -> PresetChoice:
    """The preset asked for; else, with CUDA, the first preset built for `hardware` (the Space's suggested hardware;
    `preset_hardware` in order of preference); else the embedded tiny model, which needs no GPU and no network."""
    if requested:
        return PresetChoice(requested, "asked for")
    if not cuda_available:
        return PresetChoice("tiny", "no CUDA device; LORA_PRESET picks another")
    for preset, built_for in preset_hardware.items():
        if hardware and built_for == hardware:
            return PresetChoice(preset, f"CUDA on {hardware}, the README's suggested_hardware")
    return PresetChoice("tiny", f"no preset is built for {hardware or 'unnamed hardware'}; LORA_PRESET picks one")


def suggested_hardware(readme: Path) -> str | None:
    """`suggested_hardware` from the README's front matter (the Space's configuration), None without one."""
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    front = text.split("\n---", 1)[0] if text.startswith("---") else ""
    found = re.search(r"^suggested_hardware:\s*(\S+)", front, re.MULTILINE)
    return found.group(1) if found else None


def preset_hardware() -> dict[str, str | None]:
    """The hardware each built-in GPU preset's catalog is sized for, in GPU_PRESETS' order."""
    return {name: json.loads((PRESETS / name / "catalog.json").read_text()).get("hardware") for name in GPU_PRESETS}


def default_preset(requested: str | None) -> PresetChoice:
    # ZeroGPU's `spaces` reports CUDA in this process, which has no device until a GPU function runs: tiny there
    import torch  # here, not above: imported before lora_manager, torch made the compiled start miss its bundle

    cuda = torch.cuda.is_available() and not ZERO_GPU
    return choose_preset(requested, cuda, suggested_hardware(Path(__file__).with_name("README.md")), preset_hardware())


def start_engine(args: argparse.Namespace, preset: str) -> Engine:
    """The engine the flags ask for: in this process (eager on ZeroGPU and with an AOT package) or on Ray Serve."""
    kwargs = {
        "target_rank": args.target_rank,
        "slots": args.slots,
        "max_batch": args.max_batch,
        "aot_package": args.aot_package,
        "dtype": args.dtype,
    }
    if args.cache_mb is not None:
        kwargs["cache_bytes"] = args.cache_mb * 2**20
    compile_ = False if ZERO_GPU or args.aot_package else args.compile
    if ZERO_GPU:
        kwargs.update(max_batch=1, zero_gpu=True)
        print(f"ZeroGPU: {ZERO_GPU_NOTE}", flush=True)
    try:
        if args.backend == "ray":
            return RemoteManager(args.ray_url, preset)
        return LoraManager.from_preset(preset, compile=compile_, **kwargs)
    except (ValueError, LoraManagerError) as e:  # unknown preset, bad catalog: one line, no traceback
        raise SystemExit(f"app.py: {e}") from e


def launch(demo: gr.Blocks, manager: Engine, args: argparse.Namespace) -> None:
    """Queue and serve `demo` (an MCP server too), the previews readable and uploads refused; returns at once."""
    demo.queue(default_concurrency_limit=1, max_size=64)
    previews = {str(p.parent) for a in manager.adapters() if (p := manager.asset_path(a.spec.preview))}
    none = manager.asset_path("previews/none.png")
    demo.launch(
        server_name=args.host,
        server_port=args.port,
        share=args.share,
        prevent_thread_lock=True,
        css=CSS,
        allowed_paths=sorted(previews | ({str(none.parent)} if none else set())),
        max_file_size=MAX_UPLOAD,
        show_error=True,
        mcp_server=True,
        app_kwargs={
            "middleware": [Middleware(RefusalStatus)],
            "exception_handlers": {RequestValidationError: refused_body},
        },
    )


def main(argv: list[str] | None = None) -> None:
    imports_s = time.time() - STARTED
    args = parse_args(argv)
    choice = default_preset(args.preset)
    manager = start_engine(args, choice.preset)
    manager.startup_s = {"imports": imports_s, **manager.startup_s}
    launch_t0 = time.time()
    for adapter_id, reason in manager.refused.items():
        print(f"skipped adapter {adapter_id}: {reason}", flush=True)
    additions = Additions(
        per_session=args.additions_per_visitor,
        max_count=args.max_additions,
        max_bytes=args.additions_mb * 2**20,
        shared=args.shared_additions,
    )
    cap = args.max_adapter_mb * 2**20 if args.max_adapter_mb is not None else None
    demo = build_demo(manager, additions, cap)
    launch(demo, manager, args)
    manager.startup_s["ui_launch"] = time.time() - launch_t0
    print(
        f"ready in {time.time() - STARTED:.1f} s at {demo.local_url} (preset {choice.preset}, "
        f"compiled: {manager.compile_source}, {len(manager.adapters())} adapters; {_phases(manager.startup_s)}; "
        f"preset: {choice.reason})",
        flush=True,
    )
    demo.block_thread()


if __name__ == "__main__":
    main()
