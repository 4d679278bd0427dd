"""`python -m lora_manager` as a user runs it: inspect an adapter file, generate a PNG on the embedded preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from engine_helpers import ADAPTERS
from helpers import ROOT

pytestmark = pytest.mark.slow  # each test starts a Python that imports torch and diffusers


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lora_manager", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_inspect_reads_rank_alpha_targets_and_format(adapter_dir):
    for name in ("r7_conv", "r4_kohya_te"):
        out = run("inspect", str(adapter_dir / f"{name}.safetensors"))
        assert out.returncode == 0, out.stderr
        summary = json.loads(out.stdout)
        kw = ADAPTERS[name]
        assert summary["rank"] == kw["rank"] and summary["format"] == ("kohya" if kw.get("kohya") else "peft")
        assert summary["has_text_encoder"] == bool(kw.get("te_rank"))
    conv = json.loads(run("inspect", str(adapter_dir / "r7_conv.safetensors")).stdout)
    assert conv["alphas"] == [11.0] and "unet:conv" in conv["targets"] and "unet:attention" in conv["targets"]


def test_inspect_refuses_a_pickle_with_a_clear_message(tmp_path):
    bad = tmp_path / "model.ckpt"
    bad.write_bytes(b"\x80\x04K\x01.")
    out = run("inspect", str(bad))
    assert out.returncode == 2 and "pickle file" in out.stderr and "Traceback" not in out.stderr


def test_generate_writes_a_png_with_reproducible_info(tmp_path):
    png = tmp_path / "out.png"
    out = run("generate", "--prompt", "a red circle on a blue background", "--steps", "4", "--out", str(png))
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["adapter"] is None and info["num_inference_steps"] == 4 and info["seed"] == 0
    assert Image.open(png).size == (info["width"], info["height"])
    assert "generate_ms_median" not in info and info["compile_source"] == "eager"


def test_generate_in_half_precision_from_the_flag_and_the_environment(tmp_path):
    """--dtype (or LORA_DTYPE) picks the pipeline's dtype: the app's engine, mixed batches included, in bfloat16."""
    out = run(
        "generate",
        "--prompt",
        "a red circle",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "b.png"),
        "--adapter",
        "stripes",
        "--adapter",
        "dots",
        "--max-batch",
        "4",
        "--dtype",
        "bfloat16",
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["dtype"] == "bfloat16"
    env = subprocess.run(
        [
            sys.executable,
            "-m",
            "lora_manager",
            "generate",
            "--prompt",
            "x",
            "--steps",
            "1",
            "--out",
            str(tmp_path / "h.png"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "LORA_DTYPE": "float16"},
    )
    assert env.returncode == 0, env.stderr
    assert json.loads(env.stdout)["dtype"] == "float16"
    bad = run("generate", "--prompt", "x", "--out", str(tmp_path / "x.png"), "--dtype", "half")
    assert bad.returncode == 2 and "invalid choice: 'half'" in bad.stderr


def test_generate_repeats_on_the_apps_engine_and_reports_its_latency(tmp_path):
    out = run(
        "generate",
        "--prompt",
        "a red circle",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "r.png"),
        "--adapter",
        "stripes",
        "--slots",
        "2",
        "--max-batch",
        "4",
        "--repeat",
        "3",
        "--no-compile",
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert 0 < info["generate_ms_min"] <= info["generate_ms_median"] and "template" in info["startup_s"]
    none = run("generate", "--prompt", "x", "--out", str(tmp_path / "n.png"), "--repeat", "0")
    assert none.returncode != 0 and "--repeat 0: generate at least once" in none.stderr


def test_generate_combines_adapters_given_twice(tmp_path):
    png = tmp_path / "mix.png"
    out = run(
        "generate",
        "--prompt",
        "a red circle on a blue background",
        "--steps",
        "2",
        "--out",
        str(png),
        "--adapter",
        "stripes:0.8",
        "--adapter",
        "outline",
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["adapter"] == ["stripes", "outline"] and info["strength"] == [0.8, 1.0]
    bad = run("generate", "--prompt", "x", "--steps", "1", "--out", str(png), "--adapter", "stripes:strong")
    assert bad.returncode != 0 and "ID:STRENGTH" in bad.stderr
