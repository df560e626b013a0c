"""Bootstrap intervals over timing rounds (shapewise.analysis.stats) on synthetic round times with a known spread."""

from __future__ import annotations

import numpy as np
import pytest

from shapewise.analysis import stats


def rounds_of(true_ms, rel_sigma, n_rounds, calls, seed, round_sigma=0.0):
    """Round times around true_ms: per-call noise rel_sigma, and a per-round offset round_sigma (drift)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_rounds):
        level = true_ms * (1 + rng.normal(0, round_sigma))
        out.append(list(level * (1 + rng.normal(0, rel_sigma, size=calls))))
    return out


def test_tight_rounds_give_a_narrow_interval_that_contains_the_truth():
    ref = rounds_of(2.0, 0.01, 12, 50, seed=1)
    opt = rounds_of(0.5, 0.01, 12, 50, seed=2)
    out = stats.summarize({"reference": ref, "optimized": opt})
    low, high = out["reference"]["median_ci_ms"]
    assert low <= 2.0 <= high and (high - low) / 2 / 2.0 < 0.01
    ci = out["speedup_ci"]
    assert ci["low"] <= 4.0 <= ci["high"] and ci["level"] == 0.95 and "bootstrap" in ci["method"]
    assert ci["low"] <= out["speedup"] <= ci["high"]
    assert out["noisy"] is False
    assert len(out["reference"]["round_medians_ms"]) == 12
    assert 0 < out["reference"]["rel_spread"] < 0.05


def test_rounds_that_drift_widely_are_flagged_noisy():
    ref = rounds_of(2.0, 0.02, 5, 50, seed=3, round_sigma=0.3)
    opt = rounds_of(0.5, 0.02, 5, 50, seed=4, round_sigma=0.3)
    out = stats.summarize({"reference": ref, "optimized": opt})
    ci = out["speedup_ci"]
    assert stats.rel_half_width(ci["low"], ci["high"], out["speedup"]) > stats.NOISY_HALF_WIDTH
    assert out["noisy"] is True
    assert out["reference"]["rel_spread"] > 0.2


def test_the_interval_is_deterministic():
    ref = rounds_of(1.0, 0.05, 6, 10, seed=5)
    opt = rounds_of(0.8, 0.05, 6, 10, seed=6)
    assert stats.summarize({"reference": ref, "optimized": opt}) == \
        stats.summarize({"reference": ref, "optimized": opt})


def test_one_round_gives_no_interval_and_no_verdict():
    out = stats.summarize({"reference": [[2.0, 2.1, 1.9]], "optimized": [[1.0, 1.1]]})
    assert out["reference"]["median_ci_ms"] is None and out["speedup_ci"] is None and out["noisy"] is None
    assert out["speedup"] == pytest.approx(2.0 / 1.05)
    assert out["reference"]["rel_spread"] == 0.0


def test_median_is_over_all_calls_and_rounds_of_unequal_length_work():
    out = stats.model_summary([[1.0, 2.0, 3.0], [4.0, 5.0]])
    assert out["median_ms"] == 3.0 and out["round_medians_ms"] == [2.0, 4.5]
    low, high = out["median_ci_ms"]
    assert 2.0 <= low <= high <= 4.5


def test_speedup_needs_paired_rounds():
    with pytest.raises(ValueError, match="paired"):
        stats.speedup_interval([[1.0]] * 3, [[1.0]] * 2)


def test_settled_width_uses_the_speedup_or_each_models_median():
    ref = rounds_of(2.0, 0.01, 6, 20, seed=7)
    opt = rounds_of(1.0, 0.01, 6, 20, seed=8, round_sigma=0.2)
    both = stats.settled_width({"reference": ref, "optimized": opt})
    alone = stats.settled_width({"optimized": opt})
    assert both is not None and alone is not None and alone > 0.02
    assert stats.settled_width({"reference": ref}) < 0.01
    assert stats.settled_width({"reference": ref[:1]}) is None


def test_models_with_their_own_calls_a_round_are_resampled_apart():
    """Each model's rounds may hold their own number of calls (shapewise.jobs.timing round_seconds): the speedup's
    interval resamples the same round indices of both, each model's drawn rounds pooled on their own, so over an
    optimized model of constant time it is the reference's own median interval, and settled_width its half-width."""
    ref = rounds_of(100.0, 0.02, 8, 10, seed=11, round_sigma=0.01)
    opt = [[2.0] * 50 for _ in range(8)]
    out = stats.summarize({"reference": ref, "optimized": opt})
    low, high = out["reference"]["median_ci_ms"]
    assert out["speedup"] == pytest.approx(out["reference"]["median_ms"] / 2.0)
    ci = out["speedup_ci"]
    assert (ci["low"], ci["high"]) == (pytest.approx(low / 2.0), pytest.approx(high / 2.0))
    width = stats.settled_width({"reference": ref, "optimized": opt})
    assert width == pytest.approx(stats.rel_half_width(low, high, out["reference"]["median_ms"]))


def test_paired_round_ratio_is_the_median_of_round_ratios_and_needs_paired_rounds():
    num = [[1.1, 1.2, 1.0], [2.2, 2.0], [3.3]]
    den = [[1.0], [2.0, 2.0], [3.0, 3.0]]
    out = stats.paired_round_ratio(num, den)
    assert out["round_ratios"] == pytest.approx([1.1, 1.05, 1.1]) and out["ratio"] == pytest.approx(1.1)
    assert 1.05 <= out["interval"]["low"] <= out["interval"]["high"] <= 1.1 and out["interval"]["level"] == stats.LEVEL
    alone = stats.paired_round_ratio(num[:1], den[:1])
    assert alone["ratio"] == pytest.approx(1.1) and alone["interval"] is None
    with pytest.raises(ValueError, match="paired"):
        stats.paired_round_ratio(num, den[:2])
    with pytest.raises(ValueError, match="without timed calls"):
        stats.paired_round_ratio([[1.0], []], [[1.0], [1.0]])


@pytest.mark.parametrize("rounds", [2, 3, 7, 30])
@pytest.mark.parametrize("calls", [1, 2, 7, 50])
@pytest.mark.parametrize("kind", ["normal", "ties", "drift"])
def test_resampled_medians_are_numpys_medians_of_the_pooled_rounds_bit_for_bit(rounds, calls, kind):
    rng = np.random.default_rng(rounds * 100 + calls)
    if kind == "normal":
        table = rng.normal(1.0, 0.3, (rounds, calls))
    elif kind == "ties":
        table = rng.integers(0, 4, (rounds, calls)).astype(float)
    else:  # each round slower than the one before, heavy tails
        table = np.exp(rng.normal(0.0, 1.0, (rounds, calls))) * (1.0 + np.arange(rounds)[:, None])
    draws = stats._draws(rounds)
    pooled = np.median(table[draws].reshape(draws.shape[0], -1), axis=1)
    assert np.array_equal(stats._resampled_medians(table.tolist(), draws), pooled)


def test_resampled_medians_keep_numpys_nan():
    table = [[1.0, float("nan")], [2.0, 3.0]]
    draws = stats._draws(2)
    assert np.isnan(stats._resampled_medians(table, draws)).any()
