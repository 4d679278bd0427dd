"""The skewed load test's pure parts: the Zipf draw of adapters per request, the specs of the adapters it writes, and
the percentile its latencies are reported by."""

from __future__ import annotations

import pytest

from lora_manager.bench.skewed import TARGET_SETS, lora_specs, percentile, zipf_trace, zipf_weights

pytestmark = pytest.mark.unit


def test_zipf_trace_is_seeded_and_in_range():
    trace = zipf_trace(300, 240, 1.1, seed=0)
    assert trace == zipf_trace(300, 240, 1.1, seed=0)
    assert trace != zipf_trace(300, 240, 1.1, seed=1)
    assert len(trace) == 240 and all(0 <= i < 300 for i in trace)


def test_zipf_weights_fall_with_popularity_rank_and_sum_to_one():
    weights = zipf_weights(50, 1.1)
    assert sum(weights) == pytest.approx(1)
    assert all(a > b for a, b in zip(weights, weights[1:], strict=False))
    assert weights[0] / weights[1] == pytest.approx(2**1.1)
    assert zipf_weights(4, 0.0) == pytest.approx([0.25] * 4)  # s = 0: no skew at all


def test_the_top_adapters_share_grows_with_the_exponent():
    shares = [zipf_trace(300, 4000, s, seed=7).count(0) / 4000 for s in (0.0, 0.6, 1.1, 2.0)]
    assert shares == sorted(shares) and len(set(shares)) == 4
    assert shares[2] == pytest.approx(zipf_weights(300, 1.1)[0], abs=0.03)  # the draw follows its weights


def test_fewer_distinct_adapters_are_drawn_the_more_skewed_the_trace():
    distinct = [len(set(zipf_trace(300, 240, s, seed=3))) for s in (0.0, 1.1, 2.0)]
    assert distinct == sorted(distinct, reverse=True) and distinct[0] > distinct[-1]


def test_lora_specs_mix_ranks_targets_and_alphas_off_the_rank():
    specs = lora_specs(40, seed=5, ranks=(2, 32))
    assert specs == lora_specs(40, seed=5, ranks=(2, 32))
    assert len({s.id for s in specs}) == 40
    assert all(2 <= s.rank <= 32 for s in specs) and len({s.rank for s in specs}) > 10
    assert all(s.alpha != s.rank and s.alpha > 0 for s in specs)
    assert {s.targets for s in specs} == set(TARGET_SETS)


def test_percentile_is_a_measured_value_by_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2 and percentile([5.0], 99) == 5
