"""What the test modules share besides fixtures: the repository's paths, the tiny preset's request settings, and
`python app.py` started for a test. It imports neither torch nor diffusers, so the unit tests and the conftest can
import it; what needs torch is in engine_helpers.py."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "lora_manager" / "presets" / "tiny" / "model"
GEN = {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 4.0}
PROMPT = "a red circle on a blue background"

# ---- the app, started as `python app.py` on a free local port -------------------------------------------------------
PRESET = os.environ.get("APP_TEST_PRESET", "tiny")  # another catalog (a name or a .json path): development only
CATALOG = Path(PRESET) if PRESET.endswith(".json") else ROOT / "lora_manager" / "presets" / PRESET / "catalog.json"
READY_TIMEOUT_S = 240  # a 2-core CPU can be slow to import torch + diffusers + gradio
APP_MARKS = [  # every test module that starts the app carries these
    pytest.mark.app,
    pytest.mark.skipif(not CATALOG.is_file(), reason=f"no catalog at {CATALOG} (tiny preset not built yet)"),
]


def adapter_ids() -> list[str]:
    return [a["id"] for a in json.loads(CATALOG.read_text())["adapters"]]


@contextlib.contextmanager
def running_app(*args: str, **env_overrides: str) -> Iterator[str]:
    """Start `python app.py` offline on 127.0.0.1, yield its URL once it prints 'ready in', then stop it."""
    from lora_manager import testing  # imports torch: only the tests that start the app need it

    env = {
        **os.environ,
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "OMP_NUM_THREADS": "1",  # one thread is faster than two on a CPU other processes use too
        "LORA_PRESET": PRESET,
        **env_overrides,
    }
    env.pop("LORA_COMPILE", None)
    with testing.running_app(ROOT / "app.py", args, env, READY_TIMEOUT_S) as (url, output):
        print(output.splitlines()[-1])
        yield url


def padded(data: bytes, pad: int) -> bytes:
    """A safetensors file with `pad` more bytes of metadata in its header: the same tensors, larger on disk."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header.setdefault("__metadata__", {})["padding"] = " " * pad
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the tensors' data stays 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]
