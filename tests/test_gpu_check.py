"""`python -m lora_manager gpu-check` as the GPU machine runs it, here on the CPU, eager and at 2 steps: every case
reports its numbers in one table and JSON, and a failing case is shown in its row and fails the command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT


def gpu_check(json_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "lora_manager",
            "gpu-check",
            "--device",
            "cpu",
            "--no-compile",
            "--json",
            str(json_path),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # three engines and their plain-diffusers twins in half precision on the CPU: over a minute
def test_every_case_serves_swaps_pairs_and_a_mixed_batch_without_recompiling(tmp_path):
    out = gpu_check(tmp_path / "check.json", "--cases", "tiny,sdxl,flux", "--steps", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "check.json").read_text())["rows"]
    assert [(r["case"], r["dtype"]) for r in rows] == [("tiny", "float16"), ("sdxl", "float16"), ("flux", "bfloat16")]
    for row in rows:
        assert row["ok"] and row["error"] is None and row["recompiles"] == 0 and row["finite"], row
        assert row["swap_ms_median"] > 0 and row["compile_source"] == "eager", row
        assert min(row["engine_img_s"], row["batch_img_s"], row["diffusers_img_s"]) > 0, row
    table = out.stdout.splitlines()
    assert table[-4].split()[:3] == ["case", "dtype", "seconds"]
    assert [line.split()[0] for line in table[-3:]] == ["tiny", "sdxl", "flux"]


def test_a_failing_case_is_shown_in_its_row_and_fails_the_command(tmp_path):
    out = gpu_check(tmp_path / "check.json", "--cases", "nope")
    assert out.returncode == 1
    (row,) = json.loads((tmp_path / "check.json").read_text())["rows"]
    assert row["case"] == "nope" and not row["ok"]
    assert row["error"] == "ValueError: unknown case 'nope'; known: tiny, sdxl, flux, sdxl-real"
    assert out.stdout.splitlines()[-1].split()[0] == "nope" and row["error"] in out.stdout
