"""Mixed-adapter batches: requests with different LoRAs (and strengths, none, slot mixes) in one denoising pass,
each image equal to the same request served alone, with no recompiles on a compiled engine."""

from __future__ import annotations

import collections
import random
import shutil
import threading

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from lora_manager import AdapterFormatError, LoraManager
from lora_manager.adapters.inspection import BLOCKS, CONV
from lora_manager.hotswap import batched as batched_module
from lora_manager.hotswap import merged as merged_module
from lora_manager.hotswap.groups import GROUP_COST_MACS, row_groups
from lora_manager.hotswap.merged import MERGE_MAX_WEIGHTS, Merged
from lora_manager.images import levels
from lora_manager.testing import snapshot, write_adapter

from engine_helpers import (
    assert_same_slots,
    break_while_evicted,
    load_tiny,
    make_catalog,
    mix_reference,
    run_together,
)
from helpers import PROMPT

PROMPTS = (PROMPT, "a green square on a yellow background", "a blue diamond on a white background")
# Two batches of four that between them cover ranks 4..16, alphas above/below/not a multiple of the rank,
# attention-only and attention+ff+conv targets, kohya files, text-encoder parts, strengths, none, and two-adapter mixes.
BATCHES = [
    [[("r4_attn", 0.7)], [], [("r7_conv", 1.0)], [("r8_kohya", 1.2)]],
    [
        [("r6_te", 1.0)],
        [("r4_kohya_te", 0.6)],
        [("r16_half", 0.7), ("r6_te", 1.0)],
        [("r8_kohya", 0.7), ("r4_kohya_te", 1.0)],
    ],
]


def ref(adapter_dir, mix, seed: int, prompt: str) -> np.ndarray:
    return mix_reference([(adapter_dir / f"{i}.safetensors", s) for i, s in mix], seed, prompt)


@pytest.fixture(scope="module")
def batched(adapter_dir) -> LoraManager:
    return LoraManager(load_tiny(), make_catalog(adapter_dir), max_batch=4, slots=2)


@pytest.mark.parametrize("batch", BATCHES, ids=["attn-conv-kohya-none", "te-kohya-pairs"])
def test_every_row_of_a_mixed_batch_equals_plain_diffusers_alone(batched, adapter_dir, batch):
    requests = [(mix, 10 + i, PROMPTS[i % 3]) for i, mix in enumerate(batch)]
    results = run_together(batched, requests)
    assert [r.info["batch_size"] for r in results] == [4] * 4
    base = ref(adapter_dir, [], 10, PROMPTS[0])
    for (mix, seed, prompt), result in zip(requests, results, strict=True):
        assert levels(result.image, ref(adapter_dir, mix, seed, prompt)) <= 1, mix
    assert levels(results[0].image, base) > 1  # the first row really ran its adapter, not the base model


def test_a_refused_adapter_fails_only_its_requests_and_changes_no_slot(adapter_dir, tmp_path):
    """The bad file is found only when an evicted adapter is re-read for a batch: checked before any write."""
    shutil.copy(adapter_dir / "r4_kohya_te.safetensors", tmp_path / "victim.safetensors")
    m = LoraManager(load_tiny(), make_catalog(adapter_dir, ("r4_attn", "r7_conv", "r6_te")), max_batch=4)
    m.register("victim", str(tmp_path / "victim.safetensors"))
    good = [([("r4_attn", 0.7)], 1, PROMPT), ([("r7_conv", 1.0)], 2, PROMPTS[1]), ([], 3, PROMPTS[2])]
    expected = [r.image for r in run_together(m, good)]
    break_while_evicted(m, adapter_dir, tmp_path / "victim.safetensors", ("r4_attn", "r7_conv"))

    before, swaps = snapshot(m.residency.slots), m.stats()["swaps"]
    gate = threading.Event()
    blocker = m.submit(PROMPT, callback_on_step_end=lambda *a: (gate.wait(), a[3])[1])
    futures = [m.submit(p, adapter=mix, seed=s, output_type="np") for mix, s, p in good[:2]]
    bad = m.submit(PROMPT, adapter="victim", seed=4, output_type="np")
    futures.append(m.submit(good[2][2], adapter=None, seed=3, output_type="np"))
    gate.set()
    blocker.result()
    with pytest.raises(AdapterFormatError, match="'victim'.*empty"):
        bad.result()
    results = [f.result() for f in futures]
    assert [r.info["batch_size"] for r in results] == [3] * 3
    assert all(levels(r.image, e) <= 1 for r, e in zip(results, expected, strict=True))
    assert_same_slots(before, snapshot(m.residency.slots))
    assert m.stats()["swaps"] == swaps


def test_device_slots_hold_the_batch_and_evict_the_least_recently_used(adapter_dir):
    m = LoraManager(load_tiny(), make_catalog(adapter_dir), max_batch=2, device_slots=2)
    run_together(m, [([("r4_attn", 1.0)], 0, PROMPT), ([("r7_conv", 1.0)], 0, PROMPT)])
    run_together(m, [([("r7_conv", 1.0)], 0, PROMPT)])  # r7_conv is now the more recently used
    (half,) = run_together(m, [([("r16_half", 0.5)], 0, PROMPT)])  # evicts r4_attn, used longest ago
    assert sorted(filter(None, m.stats()["live"])) == ["r16_half", "r7_conv"]
    assert m.stats()["device_slots"] == 2 and m.stats()["slots"] == 1
    # what a slot computed for the adapter it held before is never reused for the one it holds now
    assert levels(half.image, ref(adapter_dir, [("r16_half", 0.5)], 0, PROMPT)) <= 1
    (attn,) = run_together(m, [([("r4_attn", 1.0)], 0, PROMPT)])
    assert levels(attn.image, ref(adapter_dir, [("r4_attn", 1.0)], 0, PROMPT)) <= 1


@pytest.mark.compile
def test_compiled_mixed_batches_never_recompile(adapter_dir, monkeypatch):
    """Warm-up compiles one graph, dynamic in the batch dimension, for every batch size 1..4 (and one for the fused
    forward); after that no batch composition or size recompiles, and the graph is whole (`fullgraph=True`)."""
    graphs = counters["stats"]["unique_graphs"]
    # 8 device slots: four requests of two adapters each always fit in one batch
    m = LoraManager(load_tiny(), make_catalog(adapter_dir), compile=True, max_batch=4, slots=2, device_slots=8)
    assert counters["stats"]["unique_graphs"] - graphs == 2  # with the LoRA forward, and fused (the base weights)
    mixes = [
        [],
        [("r4_attn", 0.7)],
        [("r7_conv", 1.0)],
        [("r8_kohya", 1.2)],
        [("r6_te", 1.0)],
        [("r4_kohya_te", 0.6)],
        [("r16_half", 1.5)],
        [("r16_half", 0.7), ("r6_te", 1.0)],
        [("r8_kohya", 0.7), ("r4_kohya_te", 1.0)],
    ]
    rng = random.Random(0)
    checked = []
    before = m.stats()["batches"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(16):  # each also runs the blocking request alone: 32 batches
            size = (3, 4, 1, 2)[i % 4]
            requests = [(rng.choice(mixes), rng.randrange(100), rng.choice(PROMPTS)) for _ in range(size)]
            results = run_together(m, requests)
            assert [r.info["batch_size"] for r in results] == [size] * size
            if i in (0, 5, 10, 15):
                checked += list(zip(requests, results, strict=True))
        # the compiled graph runs no Python per layer: no denoiser layer plans its rows (the eager text encoder does)
        planned = collections.Counter()
        plan = batched_module.GatheredLora._plan

        def counted(layer, x):
            planned[layer.rows.keys[layer.layer][0]] += 1
            return plan(layer, x)

        monkeypatch.setattr(batched_module.GatheredLora, "_plan", counted)
        run_together(m, [(mixes[7], 1, PROMPTS[0]), (mixes[8], 2, PROMPTS[1])])  # a mixed batch (the blocker: fused)
    assert planned["unet"] == 0 and planned["text_encoder"] > 0, planned
    stats = m.stats()
    assert stats["batches"] - before >= 30 and stats["recompiles"] == 0
    for (mix, seed, prompt), result in checked:
        assert levels(result.image, ref(adapter_dir, mix, seed, prompt)) <= 1, mix


# Ranks 2..64 in one template (rank 64): each row must compute at its own rank, on its own targets, and still give
# plain diffusers' image for its request alone.
RANKED = {
    "r2_attn": dict(rank=2, alpha=3, seed=11),
    "r3_conv": dict(rank=3, alpha=1, suffixes=CONV, seed=12),
    "r64_blocks": dict(rank=64, alpha=48, suffixes=BLOCKS, seed=13, scale=0.1),
    "r33_kohya_te": dict(rank=33, alpha=20, te_rank=9, te_alpha=5, kohya=True, seed=14, scale=0.15),
    "r12_te": dict(rank=12, alpha=16, te_rank=12, te_alpha=24, seed=15),
}


@pytest.fixture(scope="module")
def ranked_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranked")
    pipe = load_tiny()
    for name, kw in RANKED.items():
        write_adapter(pipe, folder / f"{name}.safetensors", **kw)
    return folder


@pytest.mark.parametrize(
    ("batch", "merged_as"),
    [
        ([[("r2_attn", 1.0)], [("r64_blocks", 0.8)], [("r3_conv", 1.3)], []], {"bmm", "grouped"}),
        (
            [[("r33_kohya_te", 1.0)], [("r12_te", 0.7), ("r2_attn", 1.0)], [("r2_attn", 0.5)], [("r2_attn", 1.0)]],
            {"bmm"},
        ),
        (
            [[("r3_conv", 1.0), ("r64_blocks", 0.6)], [("r3_conv", 0.7)], [("r12_te", 1.0)], [("r64_blocks", 1.0)]],
            {"bmm", "grouped"},
        ),
        ([[("r3_conv", 1.0), ("r12_te", 1.0)], [("r3_conv", 0.5)], [("r3_conv", 1.0)], [("r3_conv", 0.5)]], {"rows"}),
    ],
    ids=["ranks-2-3-64-none", "kohya-te-pairs-same-adapter", "conv-pair-and-singles", "one-conv-adapter-two-strengths"],
)
@pytest.mark.parametrize(
    "group_cost",
    [0, None, "merged"],
    ids=["every-bucket-its-own-group", "buckets-merged-where-cheaper", "merged-weights-per-row"],
)
def test_each_row_computes_at_its_own_rank_and_equals_plain_diffusers_alone(
    ranked_dir, batch, merged_as, group_cost, monkeypatch
):
    if group_cost != "merged":  # LoRA branches per rank group, not each row's merged weights (the tiny layers' default)
        monkeypatch.setitem(MERGE_MAX_WEIGHTS, "cpu", 0)
    if group_cost == 0:  # every rank bucket a group of its own: rows gathered and scattered back
        monkeypatch.setitem(GROUP_COST_MACS, "cpu", group_cost)
    catalog = make_catalog(ranked_dir, tuple(RANKED))
    m = LoraManager(load_tiny(), catalog, max_batch=4, slots=2, device_slots=6)
    assert m.target_rank == 64
    merged: list[str] = []  # how each merged-weight plan a layer makes for the batch runs (`Merged.how`)

    class Recorded(Merged):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            merged.append(self.how)

    monkeypatch.setattr(merged_module, "Merged", Recorded)
    requests = [(mix, 20 + i, PROMPTS[i % 3]) for i, mix in enumerate(batch)]
    results = run_together(m, requests)
    assert [r.info["batch_size"] for r in results] == [4] * 4
    for (mix, seed, prompt), result in zip(requests, results, strict=True):
        assert levels(result.image, ref(ranked_dir, mix, seed, prompt)) <= 1, mix
    # the plan the layers ran (rows in the scheduler's order): each row's rank at each layer is the highest rank its
    # own adapters have there (0: the row skips the layer), never the template's nor another row's
    rows = m.residency.rows
    held = {a: m.registry.store.get(a).modules for mix in batch for a, _ in mix}
    expected = [[max((held[a][k].rank for a, _ in mix if k in held[a]), default=0) for k in rows.keys] for mix in batch]
    assert sorted(rows.plan[0, :, :4].T.tolist()) == sorted(expected)
    assert bool(merged) == (group_cost == "merged"), merged
    if group_cost == "merged":  # several weights: stacked per row (linear, 1x1 conv), grouped, or each on its rows
        assert merged_as <= set(merged), merged


def test_rows_are_grouped_by_rank_bucket_and_one_adapter_runs_as_one_branch():
    # rows 0 and 3 share a slot; rows 1 and 2 are in the 16 bucket, with different slots; row 4 skips the layer
    assert row_groups((5, 12, 16, 7, 0), (2, 0, 1, 2, -1)) == (((0, 3), 7, 2), ((1, 2), 16, -1))
    assert row_groups((0, 0), (-1, -1)) == ()
    assert row_groups((64, 64, 64, 64), (3, 3, 3, 3)) == (((0, 1, 2, 3), 64, 3),)
    # one more group costs 8 rank-rows: 5 and 7 would add 11 + 9 to the 16 group, so they stay a group of their
    # own, which the row without weights here joins (7 rank-rows), in slot 2's plain branch
    assert row_groups((5, 12, 16, 7, 0), (2, 0, 1, 2, -1), 8) == (((0, 3, 4), 7, 2), ((1, 2), 16, -1))
    assert row_groups((5, 0, 5, 0), (2, -1, 2, -1), 16) == (((0, 1, 2, 3), 5, 2),)
