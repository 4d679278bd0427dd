"""What the Space shows: markdown and tiles made from the engine's answers (no engine logic)."""

from __future__ import annotations

from PIL import Image, ImageDraw

from lora_manager import AdapterInfo
from lora_manager.serving import compare as comparing
from lora_manager.serving.protocol import Engine
from lora_manager.space.zerogpu import ZERO_GPU, ZERO_GPU_NOTE


def _mb(nbytes: int | None) -> str:
    return f"{(nbytes or 0) / 2**20:.1f} MB"


def placeholder_tile(text: str) -> Image.Image:
    """A neutral tile for adapters that have no preview image (e.g. added from the Hub)."""
    img = Image.new("RGB", (128, 128), (226, 232, 240))
    ImageDraw.Draw(img).text((64, 64), text[:14], fill=(51, 65, 85), anchor="mm")
    return img


def adapter_details(a: AdapterInfo | None) -> str:
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
            f"**start-up:** {phases_text(info.get('startup_s') or {}) or 'not measured'}",
        ]
    )


def phases_text(startup_s: dict[str, float]) -> str:
    return ", ".join(f"{name.replace('_', ' ')} {s:.1f} s" for name, s in startup_s.items())


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


def slider_steps(engine: Engine) -> int:
    """A steps slider's starting value: the preset's default steps, else 20."""
    return int(engine.generation_defaults.get("num_inference_steps", 20))


def header_markdown(engine: Engine) -> str:
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
