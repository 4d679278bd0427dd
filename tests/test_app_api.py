"""The app's API through gradio_client, against `python app.py` (tiny preset) started on a free local port
(helpers.running_app; APP_TEST_PRESET picks another catalog, for development only)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os

import numpy as np
import pytest

from lora_manager import testing
from lora_manager.images import levels

from helpers import APP_MARKS, CATALOG, PROMPT, READY_TIMEOUT_S, ROOT, adapter_ids, running_app

pytestmark = APP_MARKS


def test_the_app_prints_nothing_but_its_own_lines_before_ready():
    """No third-party warning, progress bar or load report before "ready": only Gradio's URL lines (the app's and its
    MCP server's) and the app's. Started as a Space starts it, with no LORA_PRESET, on a machine without CUDA: the
    tiny preset, and the ready line says why."""
    env = {k: v for k, v in os.environ.items() if k != "LORA_PRESET"} | {
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    with testing.running_app(ROOT / "app.py", [], env, READY_TIMEOUT_S) as (_, output):
        lines = output.splitlines()
    gradio_lines = (
        "* Running on local URL",
        "* To create a public link",
        "🔨 Launching MCP server:",
        "* Streamable HTTP",
    )
    assert lines[-1].startswith("ready in ") and all(
        line.startswith(gradio_lines) or not line for line in lines[:-1]
    ), output
    assert "(preset tiny, " in lines[-1] and lines[-1].endswith("preset: no CUDA device; LORA_PRESET picks another)")


def test_the_default_preset_fits_the_hardware():
    """With CUDA and no preset asked for, the app runs the preset whose catalog is sized for the README's
    suggested_hardware (the hardware the Space asks for); without CUDA, or on hardware no preset is for, tiny."""
    from lora_manager.space import cli

    hardware = cli.suggested_hardware(ROOT / "README.md")
    catalogs = cli.preset_hardware()
    on_gpu = cli.choose_preset(None, True, hardware, catalogs)
    assert on_gpu.preset != "tiny" and catalogs[on_gpu.preset] == hardware and hardware in on_gpu.reason
    assert on_gpu.preset == next(name for name, built_for in catalogs.items() if built_for == hardware)
    assert cli.choose_preset(None, False, hardware, catalogs).preset == "tiny"
    assert cli.choose_preset(None, True, "cpu-basic", catalogs) == cli.PresetChoice(
        "tiny", "no preset is built for cpu-basic; LORA_PRESET picks one"
    )
    assert cli.choose_preset("sdxl", False, hardware, catalogs) == cli.PresetChoice("sdxl", "asked for")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """The app with HF_ENDPOINT on a local Hub emulator that serves a copy of the catalog's last adapter."""
    from gradio_client import Client

    from hub_server import HubServer, Repo

    spec = json.loads(CATALOG.read_text())["adapters"][-1]
    blob = (CATALOG.parent / spec["source"]).read_bytes()
    hf_home = tmp_path_factory.mktemp("hf_home")
    with HubServer({"tester/copy": Repo({"main": {"lora.safetensors": blob, "README.md": b"# copy"}})}) as hub:
        with running_app(HF_ENDPOINT=hub.url, HF_HOME=str(hf_home), HF_HUB_OFFLINE="0") as url:
            yield Client(url, verbose=False)


def _digest(path: str) -> str:
    from PIL import Image

    return hashlib.sha256(Image.open(path).convert("RGB").tobytes()).hexdigest()


def test_generate_per_adapter(client):
    ids = ["", *adapter_ids()[:3]]
    assert len(ids) >= 3, "the catalog needs at least two adapters"
    digests = {}
    for seed, adapter in enumerate(ids):
        image, info = client.predict(PROMPT, adapter, 1.0, seed % 2, 6, api_name="/generate")
        digests[adapter] = _digest(image)
        assert info["adapter"] == (adapter or None)
        assert info["seed"] == seed % 2 and info["num_inference_steps"] == 6 and info["prompt"] == PROMPT
        assert (info["swap_ms"] > 0) == bool(adapter) and info["generate_ms"] > 0, info["swap_ms"]  # each a new one
        assert info["recompiles"] == 0
        # eager on the CPU by default; a compiled start lists its compile phase
        compiled = ["compile_artifacts", "compile", "warm_up"] if info["compiled"] else []
        assert list(info["startup_s"]) == [
            "imports",
            "pipeline_load",
            "adapter_reads",
            "template",
            *compiled,
            "ui_launch",
        ]
        assert info["compile_source"].startswith(("artifacts", "compiled") if compiled else "eager")
        assert adapter == "" or adapter in info["cpu_cache"]["adapters"]
    assert len(set(digests.values())) == len(ids), f"images not pairwise different: {digests}"

    # Same request again: same image; same adapter twice in a row: no swap.
    image, info = client.predict(PROMPT, ids[-1], 1.0, (len(ids) - 1) % 2, 6, api_name="/generate")
    assert _digest(image) == digests[ids[-1]] and info["swap_ms"] == 0


def test_generate_errors(client):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="Unknown adapter 'no-such-adapter'"):
        client.predict(PROMPT, "no-such-adapter", 1.0, 0, 2, api_name="/generate")
    with pytest.raises(AppError, match="seed must be an integer between 0 and 4294967295, got -1"):
        client.predict(PROMPT, "", 1.0, -1, 2, api_name="/generate")


def test_generate_combines_adapters_one_slot_each(client):
    """The app runs 2 hotswap slots by default: the adapter input also takes a list of [id, strength] pairs."""
    from gradio_client.exceptions import AppError
    from PIL import Image

    a, b, c = adapter_ids()[:3]
    mix, info = client.predict(PROMPT, [[a, 0.7], [b, 1.0]], 1.0, 2, 4, api_name="/generate")
    assert info["adapter"] == [a, b] and info["strength"] == [0.7, 1.0] and info["recompiles"] == 0
    parts = [client.predict(PROMPT, x, s, 2, 4, api_name="/generate")[0] for x, s in ((a, 0.7), (b, 1.0))]
    assert _digest(mix) not in {_digest(p) for p in parts}
    swapped, _ = client.predict(PROMPT, [[b, 1.0], [a, 0.7]], 1.0, 2, 4, api_name="/generate")  # order is free
    pixels = [np.asarray(Image.open(x).convert("RGB"), dtype=int) for x in (mix, swapped)]
    assert np.abs(pixels[0] - pixels[1]).max() <= 1
    with pytest.raises(AppError, match=f"'{a}' appears twice"):
        client.predict(PROMPT, [a, a], 1.0, 0, 2, api_name="/generate")
    with pytest.raises(AppError, match="3 adapters requested but this engine has 2 hotswap slot"):
        client.predict(PROMPT, [a, b, c], 1.0, 0, 2, api_name="/generate")


def test_add_adapter_refusals(client):
    status = client.predict("not a repo", "", api_name="/add_adapter")
    assert "not a valid Hub repo id" in status
    status = client.predict(str(ROOT / "lora_manager" / "presets"), "x.safetensors", api_name="/add_adapter")
    assert "local paths are not accepted" in status


def test_add_adapter_from_hub(client):
    """Download a copy of the last catalog adapter from the (local) Hub: it registers and draws like the original."""
    original = adapter_ids()[-1]
    status = client.predict("tester/copy", "", api_name="/add_adapter")
    assert status.startswith("**Added** as `copy`.") and "rank " in status, status
    copy, info = client.predict(PROMPT, "copy", 1.0, 3, 4, api_name="/generate")
    assert info["adapter"] == "copy" and "copy" in info["cpu_cache"]["adapters"]
    ref, _ = client.predict(PROMPT, original, 1.0, 3, 4, api_name="/generate")
    assert _digest(copy) == _digest(ref)


def test_concurrent_api_requests_each_get_their_own_adapter(client):
    """Concurrent requests through the Gradio API: submitted together (so they share mixed batches), each result
    equals the same request served alone within 1 level of 255: a batch of N rows rounds its matmuls differently
    from a batch of one, the base model's included."""
    from PIL import Image

    jobs = [(adapter, seed) for seed in (5, 6) for adapter in ["", *adapter_ids()[:3]]]
    pending = [client.submit(PROMPT, a, 0.9, s, 4, api_name="/generate") for a, s in jobs]
    together = [Image.open(job.result(timeout=300)[0]).convert("RGB") for job in pending]
    alone = [Image.open(client.predict(PROMPT, a, 0.9, s, 4, api_name="/generate")[0]).convert("RGB") for a, s in jobs]
    diffs = [levels(t, a) for t, a in zip(together, alone, strict=True)]
    assert max(diffs) <= 1, diffs


def test_strategies_tab_measures_every_option(client):
    _, table, report = client.predict(2, api_name="/strategies")
    results = report["results"]
    for key in ("floor_per_tensor_ms", "engine_swap_ms", "diffusers_hotswap_ms", "delete_load_ms", "load_from_disk_ms"):
        assert results[key] > 0, key
    assert report["check"]["ok"] and len(report["resident"]["forward_ms"]) == 4
    assert {row[0] for row in table["data"]} >= {"engine_swap", "diffusers_hotswap"}


def test_mcp_generate_tool_gives_the_api_image(client):
    """The Space as an MCP server, through the `mcp` SDK's streamable-HTTP client: the public endpoints are its tools
    (no UI event among them), and generate, typed and documented, returns the image /generate returns."""
    import asyncio

    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from PIL import Image

    async def session_calls():
        async with streamable_http_client(f"{client.src.rstrip('/')}/gradio_api/mcp/") as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = {tool.name: tool for tool in (await session.list_tools()).tools}
                progress = []  # Gradio's MCP server sends every output (image and info) to clients that follow progress

                async def on_progress(done, total, message):
                    progress.append(message)

                request = {"prompt": PROMPT, "adapter": adapter_ids()[1], "strength": 0.8, "seed": 4, "steps": 3}
                result = await session.call_tool("generate", request, progress_callback=on_progress)
                refused = await session.call_tool("generate", {"prompt": PROMPT, "adapter": "no-such-adapter"})
                return tools, result, refused, progress

    tools, result, refused, progress = asyncio.run(session_calls())
    assert set(tools) == {"generate", "add_adapter", "strategies"}, set(tools)
    schema = tools["generate"].inputSchema
    assert schema["required"] == ["prompt"] and schema["properties"]["seed"]["type"] == "integer"
    assert all(schema["properties"][name]["description"] for name in ("prompt", "adapter", "strength", "seed", "steps"))
    assert adapter_ids()[1] in tools["generate"].description
    images = [c for c in result.content if c.type == "image"]
    assert not result.isError and len(images) == 1 and images[0].mimeType == "image/png", result.content
    assert any("swapping adapter" in (m or "") for m in progress), progress
    tool_image = Image.open(io.BytesIO(base64.b64decode(images[0].data))).convert("RGB")
    api_image, _ = client.predict(PROMPT, adapter_ids()[1], 0.8, 4, 3, api_name="/generate")
    assert levels(tool_image, Image.open(api_image).convert("RGB")) <= 1
    assert refused.isError and "Unknown adapter 'no-such-adapter'" in refused.content[0].text
