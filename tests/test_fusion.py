"""The fused one-adapter path (`hotswap/fusion.py`): a call whose rows all run the same adapters runs them merged into
the base weights, with no LoRA branch, as plain diffusers' `fuse_lora` does; the base weights come back bit for bit
after any sequence of merges, swaps, strengths, mixed batches, refused adapters and failed merges."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lora_manager import LoraManager
from lora_manager.images import levels

from engine_helpers import as_float, load_tiny, make_catalog, run_together
from helpers import GEN, PROMPT


def fused_reference(adapter_path, strength: float = 1.0, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """Plain diffusers with the adapter loaded and fused into the weights (`fuse_lora`)."""
    pipe = load_tiny(dtype)
    pipe.load_lora_weights(str(adapter_path.parent), weight_name=adapter_path.name, adapter_name="ref")
    pipe.fuse_lora(lora_scale=strength)
    pipe.unet.eval()
    pipe.text_encoder.eval()
    return pipe(PROMPT, generator=torch.Generator("cpu").manual_seed(0), output_type="np", **GEN).images[0]


def lora_calls(m: LoraManager) -> list[int]:
    """Counts calls of every template layer's PEFT lora_A module: the LoRA branch without mixed batches."""
    counts = [0]

    def hook(*_):
        counts[0] += 1

    for comp, module in m.residency.slots[0].modules:
        m.components[comp].get_submodule(module).lora_A["slot0"].register_forward_pre_hook(hook)
    return counts


@pytest.mark.parametrize("adapter, strength", [("r7_conv", 1.0), ("r6_te", 0.6), ("r8_kohya", 1.0)])
def test_one_adapter_runs_merged_with_no_lora_branch_as_fuse_lora_does(adapter_dir, adapter, strength):
    with LoraManager(load_tiny(), make_catalog(adapter_dir)) as m:
        calls = lora_calls(m)
        got = as_float(m, adapter, strength)
        assert m.stats()["fused"] and calls[0] == 0
        assert levels(got, fused_reference(adapter_dir / f"{adapter}.safetensors", strength)) <= 1
    with LoraManager(load_tiny(), make_catalog(adapter_dir), fuse=False) as unfused:
        calls = lora_calls(unfused)
        assert levels(as_float(unfused, adapter, strength), got) <= 1
        assert not unfused.stats()["fused"] and calls[0] > 0
        assert unfused.stats()["fused_off"] == "turned off (fuse=False)"


def test_merged_weights_cost_one_copy_of_the_merged_layers_base_weights_only(adapter_dir):
    """The copy that restores the base covers the layers the merged adapter targets, and is dropped on restore."""
    with LoraManager(load_tiny(), make_catalog(adapter_dir), max_batch=2) as m:
        weights = m.residency.fusion.weights
        assert len(weights) == m.stats()["template_modules"] and m.stats()["fused_bytes"] == 0
        for adapter in ("r4_attn", "r7_conv"):
            m.generate(PROMPT, adapter=adapter, steps=1)
            targeted = m.registry.weights(adapter).modules.keys()
            assert 0 < len(targeted) < len(weights)
            assert m.stats()["fused"] and m.stats()["fused_bytes"] == sum(
                weights[k].numel() * weights[k].element_size() for k in targeted
            )
        run_together(m, [("r4_attn", 0, PROMPT), ("r7_conv", 1, PROMPT)])
        assert not m.stats()["fused"] and m.stats()["fused_bytes"] == 0


def test_base_weights_stay_bit_identical_through_merges_swaps_strengths_and_failures(adapter_dir, tmp_path):
    """A long random sequence of single requests, mixes, strengths, no-adapter requests, refused registrations and
    merges that fail half way; whenever a call ran unmerged, and at the end, every base weight is its first bytes."""
    bad = tmp_path / "nan.safetensors"
    bad.write_bytes((adapter_dir / "r4_attn.safetensors").read_bytes()[:-64])  # a truncated file
    rng = random.Random(0)
    ids = ["r4_attn", "r7_conv", "r16_half", "r8_kohya", "r6_te", "r4_kohya_te"]
    with LoraManager(load_tiny(), make_catalog(adapter_dir), slots=2) as m:
        fusion = m.residency.fusion
        first = {k: w.clone() for k, w in fusion.weights.items()}
        reference = as_float(m, "r7_conv", 0.8)
        for step in range(40):
            kind = rng.choice(["one", "mix", "none", "refused", "fail"])
            if kind == "refused":
                with pytest.raises(Exception, match="'bad'"):
                    m.register("bad", str(bad))
                continue
            failures = m.stats()["fused_failures"]
            if kind == "fail":
                fusion.weights = FailingAfter(fusion.weights, rng.randrange(1, len(first)))
            adapter = {
                "one": rng.choice(ids),
                "mix": [(a, round(rng.uniform(0.2, 1.2), 2)) for a in rng.sample(ids, 2)],
                "none": None,
            }.get(kind, rng.choice(ids))
            m.generate(PROMPT, adapter=adapter, strength=round(rng.uniform(0.3, 1.0), 2), seed=step, steps=1)
            if kind == "fail":
                fusion.weights = fusion.weights.inner
            if m.stats()["fused_failures"] > failures:
                assert not m.stats()["fused"]  # the merge failed half way: that call ran unmerged
            if not m.stats()["fused"]:
                assert all(torch.equal(first[k], w) for k, w in fusion.weights.items()), step
        assert m.stats()["fused_failures"] > 0 and m.stats()["fused_merges"] > 10
        fusion.run(None)
        assert all(torch.equal(first[k], w) for k, w in fusion.weights.items())
        assert np.array_equal(as_float(m, "r7_conv", 0.8), reference)


class FailingAfter(dict):
    """The base weights, failing on the n-th read: a merge that stops half way, as a device error would."""

    def __init__(self, inner: dict, n: int):
        super().__init__(inner)
        self.inner, self.left = inner, n

    def __getitem__(self, key):
        self.left -= 1
        if self.left == 0:
            raise RuntimeError("injected: a copy failed half way")
        return super().__getitem__(key)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_merges_as_close_to_float32_as_fuse_lora_does(adapter_dir, dtype):
    """Merged in float32 and rounded once, the half-precision weights give images at most as far from the float32
    fused model as plain diffusers' `fuse_lora` in that dtype (mean levels of 255, with its tolerance)."""
    with LoraManager(load_tiny(dtype), make_catalog(adapter_dir)) as m:
        first = {k: w.clone() for k, w in m.residency.fusion.weights.items()}
        for adapter in ("r16_half", "r7_conv", None):
            got = as_float(m, adapter)
            assert m.stats()["fused"] and np.isfinite(got).all()
            if adapter is not None:
                path = adapter_dir / f"{adapter}.safetensors"
                truth = fused_reference(path)
                ours, own = mean_levels(got, truth), mean_levels(fused_reference(path, dtype=dtype), truth)
                assert ours <= 1.5 * own + 1.0, (adapter, ours, own)
        m.residency.fusion.run(None)
        assert all(torch.equal(first[k], w) for k, w in m.residency.fusion.weights.items())


def mean_levels(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).mean() * 255)


def test_a_mixed_batch_runs_unmerged_and_the_next_one_adapter_batch_merged(adapter_dir):
    with (
        LoraManager(load_tiny(), make_catalog(adapter_dir), max_batch=4) as m,
        LoraManager(load_tiny(), make_catalog(adapter_dir), max_batch=4, fuse=False) as unfused,
    ):
        for adapters, fused in ((["r4_attn", "r7_conv", None], False), (["r16_half"] * 3, True), ([None] * 2, True)):
            requests = [([(a, 1.0)] if a else [], i, PROMPT) for i, a in enumerate(adapters)]
            got, want = run_together(m, requests), run_together(unfused, requests)
            assert got[0].info["batch_size"] == len(adapters) and m.stats()["fused"] is fused
            assert all(levels(g.image, w.image) <= 1 for g, w in zip(got, want, strict=True))
