"""The Blocks layout: tabs, components and the events that bind them to the handlers."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import gradio as gr
from gradio.components.api_component import Api
from gradio.utils import get_function_params
from gradio_client.utils import python_type_to_json_schema

from lora_manager.serving.additions import Additions
from lora_manager.serving.protocol import Engine
from lora_manager.space.form import GenerateForm, generate_from_form
from lora_manager.space.handlers import (
    COMPARE_MAX,
    SEED_MAX,
    Space,
    adapter_choices,
    add_adapter,
    compare,
    compare_choices,
    gallery_items,
    generate,
    refreshed_choices,
    select,
    session_closed,
)
from lora_manager.space.refusals import check_input_count
from lora_manager.space.strategies import strategies
from lora_manager.space.views import adapter_details, header_markdown, info_markdown, slider_steps
from lora_manager.space.zerogpu import gpu

# Gradio lets this many generate calls reach the engine at once; its scheduler runs one at a time, grouped by adapter,
# and answers "Busy ... retry" when its own queue is full.
GENERATE_CONCURRENCY = 8
CSS = """
#gallery .thumbnail-item img, #compare-gallery .thumbnail-item img, #output-image img { image-rendering: pixelated; }
#output-image img { width: 100%; height: 100%; object-fit: contain; }
#gallery .grid-wrap.fixed-height { min-height: 0; }
#info-panel { min-height: 7em; }
"""


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
        details = gr.Markdown(adapter_details(None), elem_id="adapter-details")
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
        steps = gr.Slider(1, 50, slider_steps(engine), step=1, label="Steps")
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
            steps = gr.Slider(1, 50, slider_steps(engine), step=1, label="Steps", elem_id="compare-steps")
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
        gr.Markdown(header_markdown(engine))
        with gr.Tab("Generate"):
            _generate_tab(demo, space)
        _compare_tab(space)
        with gr.Tab("Strategies"):
            _strategies_tab()
    demo.validate_inputs = check_input_count  # too few values: a 422 that names the counts
    return demo
