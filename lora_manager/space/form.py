"""The Generate tab's form: its components, and their values as /generate's named arguments."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import gradio as gr

from lora_manager.request_schema import MAX_ID_CHARS, MAX_PROMPT_CHARS
from lora_manager.space.handlers import SEED_MAX, Space, with_triggers
from lora_manager.space.refusals import number_field, text_field
from lora_manager.space.views import info_markdown


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
    prompt = text_field(values[form.prompt], "Prompt", MAX_PROMPT_CHARS)
    strength = number_field(values[form.strength], "Strength", 1.0)
    rows = [(values[form.adapter_id], strength)] + [(values[a], values[s]) for a, s in form.extra]
    mix = [[text_field(i, "adapter", MAX_ID_CHARS), number_field(s, "strength", strength)] for i, s in rows if i]
    if values[form.add_trigger] is True:
        prompt = with_triggers(space.engine, prompt, [i for i, _ in mix])
    randomize = values[form.randomize] is True
    seed = random.randint(0, SEED_MAX) if randomize else round(number_field(values[form.seed], "Seed", 0.0))
    steps = round(number_field(values[form.steps], "Steps", 0.0)) or None
    return {"prompt": prompt, "adapter": mix, "strength": strength, "seed": seed, "steps": steps}


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
