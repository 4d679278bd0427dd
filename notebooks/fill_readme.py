"""Rewrite the generated blocks of README.md and docs/performance.md from the committed runs' JSON files.

    python notebooks/fill_readme.py            # rewrite the blocks in place
    python notebooks/fill_readme.py --check    # exit 1 if a block differs from what the JSON gives

A block is the text between `<!-- results:NAME:start -->` and `<!-- results:NAME:end -->`; everything outside the
markers is left alone. The notebook's last cell shows `results_table(...)` of the same JSON, and
tests/test_notebook.py checks that the README blocks and the committed notebook's output equal what this script
writes, so a number quoted in the README is the number the committed run measured.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_JSON = ROOT / "notebooks" / "figures" / "results.json"
README = ROOT / "README.md"
PERFORMANCE_DOC = ROOT / "docs" / "performance.md"
BENCH = {  # other runs quoted next to the notebook's tiny-model row in the Performance table
    "SDXL-size, CPU, bf16": ROOT / "notebooks" / "figures" / "bench_sdxl_cpu.json",
    "SDXL-size, H200, bf16": ROOT / "notebooks" / "figures" / "bench_sdxl_h200.json",
}
SKEWTEST = {  # `python -m lora_manager skewtest [--compile] --json PATH`: one row per mode whose run is committed
    "eager": ROOT / "notebooks" / "figures" / "skewtest_tiny_cpu.json",
    "compiled": ROOT / "notebooks" / "figures" / "skewtest_tiny_cpu_compiled.json",
}
BENCH_COLUMNS = (
    "floor_flat_ms",
    "floor_per_tensor_ms",
    "engine_swap_ms",
    "engine_swap_mixed_ms",
    "diffusers_hotswap_ms",
    "diffusers_hotswap_dict_ms",
    "set_adapters_10_resident_ms",
    "delete_load_ms",
    "unload_load_ms",
)


def load(path: Path = RESULTS_JSON) -> dict:
    return json.loads(Path(path).read_text())


def values(data: dict) -> dict:
    return {r["key"]: r["value"] for r in data["results"]}


def fmt(v) -> str:
    if isinstance(v, list):
        return " / ".join(fmt(x) for x in v)
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def results_table(data: dict) -> str:
    """Every value the notebook's run recorded, in the order it measured them (the notebook's recap shows this)."""
    lines = ["| measurement (tiny model, this run) | value |", "|---|---|"]
    lines += [f"| {r['label']} | {fmt(r['value'])} |" for r in data["results"]]
    return "\n".join(lines)


def run_line(data: dict) -> str:
    run = data["run"]
    return (
        f"torch {run['torch']}, diffusers {run['diffusers']}, peft {run['peft']}; {run['cpu_count']} CPU cores; "
        f"inductor cache {run['inductor_cache']}; {run['notebook_s']:.0f} s in all"
    )


def tutorial_block(data: dict) -> str:
    v = values(data)
    rows = [
        ("reload per request (`delete_adapters` + `load_lora_weights`)", v["reload_ms"]),
        (f"`set_adapters` with {v['resident_max']} LoRAs loaded", v["set_adapters_max_ms"]),
        (
            "plain diffusers hotswap, from the file / from a cached dict",
            f"{fmt(v['hotswap_file_ms'])} / {fmt(v['hotswap_dict_ms'])}",
        ),
        (
            f"**LoraManager swap** (a bare copy of the same tensors: {fmt(v['floor_per_tensor_ms'])})",
            f"**{fmt(v['engine_swap_ms'])}**",
        ),
    ]
    lines = [f"From that run ({run_line(data)}):", "", "| per adapter switch (tiny model) | ms |", "|---|---|"]
    lines += [f"| {name} | {fmt(val)} |" for name, val in rows]
    recompiles = v["recipe_graphs"] - 1
    lines += [
        "",
        f"UNet forward: no LoRA {fmt(v['fwd_base_ms'])} ms; the manager's template (rank {v['template_rank']}) "
        f"{fmt(v['fwd_template_ms'])} ms; {v['resident_max']} LoRAs loaded, all active "
        f"{fmt(v['fwd_resident_all_active_ms'])} ms, one active {fmt(v['fwd_resident_one_active_ms'])} ms. The recipe "
        f"above took {fmt(v['recipe_cell_s'])} s, inductor compile included (one more image: "
        f"{fmt(v['recipe_image_s'])} s), with {recompiles} recompiles. Compiled, `set_adapters` through "
        f"{v['resident_max']} active sets made {v['recompile_limit_sets_compiled']} graphs (`recompile_limit`); the "
        f"other {v['resident_max'] - v['recompile_limit_sets_compiled']} ran eager. The manager's compiled UNet: "
        f"{v['recompiles_after_swaps']} recompiles over {v['compiled_swaps']} swaps ({v['compiled_swap_range']}).",
    ]
    return "\n".join(lines)


def performance_block(data: dict) -> str:
    v = values(data)
    header = (
        "| ms per switch | floor: one copy | floor: copy per tensor | **engine swap** | engine, mixed ranks | "
        "diffusers hotswap (file) | hotswap (dict) | set_adapters, 10 resident | delete + load | unload + load |"
    )
    lines = [header, "|" + "---|" * 10]
    for name, path in BENCH.items():
        run = json.loads(path.read_text())
        r, torch_version = run["results"], run["versions"]["torch"].split("+")[0]
        cells = [fmt(r[k]) for k in BENCH_COLUMNS]
        cells[2] = f"**{cells[2]}** ({r['engine_swap_ms'] / r['floor_per_tensor_ms']:.2f}× floor)"
        lines.append(f"| {name}, torch {torch_version} | " + " | ".join(cells) + " |")
    ranks = ", ".join(map(str, v["swap_cycle_ranks"]))
    tiny = [
        v["floor_flat_ms"],
        v["floor_per_tensor_ms"],
        f"**{fmt(v['engine_swap_ms'])}** (ranks {ranks})",
        "—",
        v["hotswap_file_ms"],
        v["hotswap_dict_ms"],
        v["set_adapters_max_ms"] if v["resident_max"] == 10 else "—",
        v["reload_ms"],
        v["reload_unload_ms"],
    ]
    label = "tiny, CPU, fp32 (the tutorial's run; fastest sample, not median)"
    lines.append(f"| {label} | " + " | ".join(fmt(c) for c in tiny) + " |")
    counts = v["resident_counts"]
    lines += [
        "",
        f"Tiny model, the tutorial's run: a UNet forward takes "
        f"{' / '.join(fmt(x) for x in v['fwd_resident_ms'])} ms with {' / '.join(map(str, counts))} of "
        f"{v['resident_max']} loaded LoRAs active (unused ones at weight 0), "
        f'{fmt(v["fwd_resident_one_active_ms"])} ms with only one active (`set_adapters("x")`), against '
        f"{fmt(v['fwd_template_ms'])} ms for the manager's template and {fmt(v['fwd_base_ms'])} ms without LoRA.",
    ]
    return "\n".join(lines)


def skewtest_block(data: dict) -> str:
    """The skewed load test's table: per mode, the one-adapter run against the Zipf run on the same engine."""
    header = (
        "| tiny, CPU | req/s: one → Zipf | p50 / p99 s: one → Zipf | failed | Zipf: adapters drawn; cache hits / "
        "misses / evictions; worker reads | recompiles |"
    )
    lines = [header, "|" + "---|" * 6]
    for mode, path in SKEWTEST.items():
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        one, zipf = r["runs"]
        latency = lambda run: f"{fmt(run['latency_p50_s'])} / {fmt(run['latency_p99_s'])}"  # noqa: E731
        cache = " / ".join(str(zipf[k]) for k in ("cache_hits", "cache_misses", "cache_evictions"))
        reads = "—" if zipf["worker_reads"] is None else zipf["worker_reads"]
        cells = [
            f"{fmt(one['throughput_rps'])} → {fmt(zipf['throughput_rps'])} ({r['skewed_over_one_throughput']:.2f}×)",
            f"{latency(one)} → {latency(zipf)} (p99 {r['skewed_over_one_p99']:.2f}×)",
            one["failed"] + zipf["failed"],
            f"{zipf['distinct_adapters']}; {cache}; {reads}",
            one["recompiles"] + zipf["recompiles"],
        ]
        lines.append(f"| {mode} | " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


BLOCKS = {"tutorial": tutorial_block, "performance": performance_block, "skewtest": skewtest_block}
FILES = {"tutorial": README, "performance": README, "skewtest": PERFORMANCE_DOC}  # the page each block is in


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- results:{name}:start -->\n)(.*?)(<!-- results:{name}:end -->)", re.S)


def fill(text: str, data: dict, names) -> str:
    """`text` with the blocks `names` rewritten from `data`."""
    for name in names:
        if not _pattern(name).search(text):
            raise SystemExit(f"no results:{name} markers where they belong ({FILES[name].name})")
        body = BLOCKS[name](data)
        text = _pattern(name).sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(3), text)
    return text


def blocks() -> dict[str, str]:
    """The pages' current generated blocks, by name."""
    return {name: _pattern(name).search(path.read_text()).group(2).removesuffix("\n") for name, path in FILES.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if a page is stale")
    parser.add_argument("--results", type=Path, default=RESULTS_JSON)
    args = parser.parse_args(argv)
    data, stale = load(args.results), []
    for path in dict.fromkeys(FILES.values()):
        old = path.read_text()
        new = fill(old, data, [name for name, page in FILES.items() if page == path])
        if new != old:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"stale: {', '.join(map(str, stale))}; run python notebooks/fill_readme.py", file=sys.stderr)
        return 1
    if not args.check:
        print(f"rewrote {', '.join(map(str, stale)) or 'nothing'} from {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
