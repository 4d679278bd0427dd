"""A skewed workload, as pure functions (no torch): the specs of many LoRAs of mixed ranks, target sets and alphas, and
a trace of requests whose adapters follow a Zipf law over them, as real traffic does (a few adapters are asked for
most of the time, most adapters rarely)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# which modules an adapter changes, by name (`lora_zoo.TARGETS` maps each to module suffixes): attention only,
# attention and feed-forward, the ResNet convolutions only, and the UNet's blocks plus the text encoder's attention
TARGET_SETS = ("attention", "attention+ff", "conv", "blocks+text")
ALPHA_FACTORS = (0.5, 0.75, 1.5, 2.0)  # alpha = rank x one of these: never the rank itself, as in published files


@dataclass(frozen=True)
class LoraSpec:
    """One generated adapter: its id, rank, alpha, target set (a TARGET_SETS name) and the seed of its weights."""

    id: str
    rank: int
    alpha: float
    targets: str
    seed: int


def lora_specs(n: int, seed: int, ranks: tuple[int, int] = (2, 32)) -> list[LoraSpec]:
    """`n` adapters with ranks drawn from `ranks` (inclusive), target sets in turn and alphas off their rank."""
    rng = random.Random(seed)
    low, high = ranks
    specs = []
    for i in range(n):
        rank = rng.randint(low, high)
        alpha = rank * rng.choice(ALPHA_FACTORS)
        specs.append(LoraSpec(f"zipf-{i:04d}", rank, alpha, TARGET_SETS[i % len(TARGET_SETS)], rng.randrange(2**31)))
    return specs


def zipf_weights(n: int, s: float) -> list[float]:
    """P(the k-th most popular of n items) for k = 1..n under Zipf(s): proportional to 1 / k**s, summing to 1."""
    raw = [1 / k**s for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def zipf_trace(n: int, requests: int, s: float, seed: int) -> list[int]:
    """`requests` item indices in 0..n-1 drawn from Zipf(s), index 0 the most popular; the same for the same seed."""
    return random.Random(seed).choices(range(n), weights=zipf_weights(n, s), k=requests)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 < q <= 100) by the nearest-rank method: a value that was measured, never interpolated."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
