"""The tiny-scale bench end to end through the CLI: a complete report, and the engine equal to diffusers' hotswap.

No speed is asserted: timings depend on the machine and its load; docs/performance.md quotes measured runs with
their commands.
"""

from __future__ import annotations

import json

import pytest
import torch

from lora_manager.__main__ import main
from lora_manager.bench import bench

SWAP_KEYS = (
    "floor_flat_ms",
    "floor_per_tensor_ms",
    "engine_swap_ms",
    "engine_swap_mixed_ms",
    "diffusers_hotswap_ms",
    "diffusers_hotswap_dict_ms",
    "set_adapters_10_resident_ms",
    "load_from_disk_ms",
    "delete_load_ms",
    "unload_load_ms",
)


pytestmark = pytest.mark.slow  # builds and times every strategy on fresh pipelines


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--scale", "tiny", "--repeats", "2", "--threads", "1", "--device", "cpu"]
    assert main([*argv, "--json", str(out / "bench.json"), "--plot", str(out / "bench.png")]) == 0
    return json.loads((out / "bench.json").read_text()), out / "bench.png"


def test_report_is_complete(bench_run):
    report, plot = bench_run
    assert (report["scale"], report["dtype"], report["device"]) == ("tiny", "float32", "cpu")
    assert set(report["versions"]) == {"torch", "diffusers", "peft"}
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["torch_threads"] == 1
    for key in SWAP_KEYS:
        assert report["results"][key] > 0, key
        assert len(report["samples_ms"][key]) == 2, key
    resident = report["resident"]
    assert resident["counts"] == [1, 2, 5, 10]
    assert len(resident["forward_ms"]) == 4 and all(v > 0 for v in resident["forward_ms"] + resident["set_adapters_ms"])
    assert resident["engine_forward_ms"] > 0
    slots = report["slots"]
    assert slots["counts"] == [1, 2, 3] and slots["base_forward_ms"] > 0 and len(slots["forward_ms"]) == 3
    assert all(v > 0 for v in slots["forward_ms"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_engine_swap_equals_diffusers_hotswap(bench_run):
    """Two separate UNets, one swapped by the engine and one hotswapped by diffusers from the file (largest rank,
    then smallest, so stale padding would show), give the same output; the adapter visibly changes that output."""
    check = bench_run[0]["check"]
    assert check["sequence"] == ["frame", "checker"]  # ranks 32 then 4 (kohya keys)
    assert check["output_lora_effect"] > 1e-2
    assert check["output_max_abs_diff"] <= 1e-5
    assert check["effective_weights_max_abs_diff"] <= 1e-5
    assert check["ok"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_engine_swap_equals_diffusers_hotswap_in_half_precision(dtype):
    """The same check on the tiny workload in the GPU presets' dtypes: the engine's swaps and diffusers' hotswap leave
    the same weights and outputs."""
    check = bench.engine_matches_hotswap(bench.tiny_workload(torch.device("cpu"), dtype))
    assert check["ok"] and check["output_lora_effect"] > 1e-2, check


SKEW_RUN_KEYS = {
    "requests",
    "answered",
    "failed",
    "distinct_adapters",
    "throughput_rps",
    "latency_p50_s",
    "latency_p99_s",
    "cache_hits",
    "cache_misses",
    "cache_evictions",
    "worker_reads",
    "batches",
    "swaps",
    "recompiles",
    "peak_cache_bytes",
    "cache_budget_bytes",
    "rss_peak_bytes",
}


@pytest.fixture(scope="module")
def skew_run(tmp_path_factory):
    """The skewed load test, small: 40 adapters, 24 requests of 2 steps per run, a cache for half the adapters'
    bytes: room for the largest five (four live on the device, one coming in), too little for all."""
    out = tmp_path_factory.mktemp("skewtest") / "skewtest.json"
    argv = ["skewtest", "--adapters", "40", "--cache-fraction", "0.5", "--requests", "24", "--clients", "4"]
    assert main([*argv, "--steps", "2", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_skewtest_report_is_complete(skew_run):
    assert skew_run["refused"] == {}
    assert [r["name"] for r in skew_run["runs"]] == ["one adapter", "Zipf(1.1) over 40"]
    for run in skew_run["runs"]:
        assert SKEW_RUN_KEYS <= run.keys()
        assert run["failed"] == 0 and run["answered"] == run["requests"] == 24, run["errors"]
        assert 0 < run["latency_p50_s"] <= run["latency_p99_s"]
        assert run["peak_cache_bytes"] <= run["cache_budget_bytes"] == skew_run["cache_budget_bytes"]
        assert -(-run["answered"] // skew_run["max_batch"]) <= run["batches"] <= run["answered"]
        assert run["recompiles"] == 0
    one, skewed = skew_run["runs"]
    assert skew_run["skewed_over_one_throughput"] == pytest.approx(skewed["throughput_rps"] / one["throughput_rps"])
    assert skew_run["skewed_over_one_p99"] == pytest.approx(skewed["latency_p99_s"] / one["latency_p99_s"])


def test_skewtest_counts_are_consistent(skew_run):
    one, skewed = skew_run["runs"]
    # the one adapter stays on the device after the warm-up: no swap, so no cache lookup
    assert one["distinct_adapters"] == 1 and one["swaps"] == one["cache_hits"] + one["cache_misses"] == 0
    assert 1 < skewed["distinct_adapters"] <= skew_run["adapters"]
    # every adapter swapped onto the device was looked up in the CPU cache; a cache at 60% of the bytes misses some
    assert skewed["cache_hits"] + skewed["cache_misses"] >= skewed["swaps"] >= 1
    assert skewed["cache_misses"] >= 1


@pytest.mark.slow
def test_real_width_bench_runs_every_row_on_one_pipeline_and_writes_its_ratios(tmp_path):
    """`bench --real-width`'s rows and report, on a small pipeline of SDXL's layout (the real width takes 10 GB)."""
    from lora_manager.bench import real_width
    from lora_manager.bench.mini_pipelines import mini_sdxl

    out = tmp_path / "real_width.json"
    report = real_width.run(
        "sdxl", "cpu", torch.float32, 8, 1, 4, 2, False, out, build=lambda dtype, device: mini_sdxl(0, dtype, device)
    )
    written = json.loads(out.read_text())
    names = {"plain diffusers, one LoRA", "plain diffusers, fused", "pipeline direct, merged"}
    names |= {"plain diffusers, one LoRA, worker thread", "plain diffusers, fused, worker thread"}
    names |= {f"engine, {row}" for row in ("no adapter", "one adapter", "ranks 8/4/16/64", "four rank-8")}
    assert set(written["rows"]) == names and all(len(r["ms_per_image"]) == 2 for r in written["rows"].values())
    assert all(t > 0 for r in written["rows"].values() for t in r["ms_per_image"])
    assert set(written["ratios"]) == set(report.ratios) and len(report.ratios) == 8 and written["recompiles"] == 0
    assert "engine one adapter / pipeline direct, merged" in real_width.table(report)
