"""How sure a timing is: bootstrap intervals over the rounds of a timing protocol.

A round is one block of back-to-back calls of one model; the rounds of the two models alternate, so round i of
the reference and round i of the optimized model ran close together in time. The round is the unit that is
resampled (calls within a round share the host's and the GPU's state of that moment and are not independent).

- a model's median: median of all its timed calls; its interval: the percentile bootstrap of that median,
  resampling rounds with replacement (the calls of the chosen rounds pooled);
- the speedup: reference median / optimized median; its interval resamples the same round indices for both
  models (paired), so a slow moment of the machine moves both;
- noisy: the speedup interval's half-width exceeds NOISY_HALF_WIDTH of the speedup.

Seeded and deterministic: the same round times give the same intervals.
"""

from __future__ import annotations

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000
SEED = 0
MIN_ROUNDS = 2  # fewer rounds give no interval (a single round cannot show its own spread)
NOISY_HALF_WIDTH = 0.05
METHOD = (f"percentile bootstrap over rounds ({RESAMPLES} resamples, seed {SEED}): rounds drawn with replacement, "
          "the same draw for both models; statistic: median of the pooled calls of the drawn rounds")


def round_medians(rounds):
    return [float(np.median(r)) for r in rounds]


def rel_spread(rounds):
    """max / min of the round medians minus 1 (0 for one round; None without rounds)."""
    medians = round_medians(rounds)
    if not medians:
        return None
    return max(medians) / min(medians) - 1.0


def _draws(n_rounds):
    rng = np.random.default_rng(SEED)
    return rng.integers(0, n_rounds, size=(RESAMPLES, n_rounds))


def _resampled_medians(rounds, draws):
    """The median of the pooled calls of each resample (one row of `draws` = the round indices drawn)."""
    lengths = {len(r) for r in rounds}
    if len(lengths) == 1:
        table = np.asarray(rounds, dtype=float)  # (rounds, calls)
        if np.isnan(table).any():
            return np.median(table[draws].reshape(draws.shape[0], -1), axis=1)
        return _pooled_medians(table, draws)
    arrays = [np.asarray(r, dtype=float) for r in rounds]
    return np.array([np.median(np.concatenate([arrays[i] for i in row])) for row in draws])


def _pooled_medians(table, draws):
    """np.median of each resample's pooled calls (table[draws[i]] flattened), bit for bit, without building them.

    A resample's median lies between the lowest lower-middle and the highest upper-middle call of the rounds
    (each drawn round has more than half its calls on either side of its own middle): only calls in that window
    are ranked, each weighted by how often its round was drawn, the calls below it counted per round. The
    stopping rule asks this after every round: np.median of the pooled copies took ~4x the time."""
    n_rounds, calls = table.shape
    resamples, drawn = draws.shape
    pooled = drawn * calls
    middle = ((pooled - 1) // 2, pooled // 2)
    ranked = np.sort(table, axis=1)
    low, high = ranked[:, (calls - 1) // 2].min(), ranked[:, calls // 2].max()
    counts = np.bincount((draws + n_rounds * np.arange(resamples)[:, None]).ravel(),
                         minlength=resamples * n_rounds).reshape(resamples, n_rounds)
    below = counts @ (table < low).sum(axis=1)  # each resample's calls under the window
    rows, cols = np.nonzero((table >= low) & (table <= high))
    order = np.argsort(table[rows, cols], kind="stable")
    values, rounds_of = table[rows, cols][order], rows[order]
    ranks = below[:, None] + np.cumsum(counts[:, rounds_of], axis=1)  # calls up to each window value
    picked = [values[(ranks <= k).sum(axis=1)] for k in middle]
    if middle[0] == middle[1]:
        return picked[0]
    return np.mean(np.stack(picked, axis=1), axis=1)  # as np.median takes the mean of the middle two


def _interval(samples):
    tail = (1.0 - LEVEL) / 2.0
    low, high = np.quantile(samples, [tail, 1.0 - tail])
    return float(low), float(high)


def _check(rounds, name):
    if any(len(r) == 0 for r in rounds):
        raise ValueError(f"{name}: a round without timed calls")


def model_summary(rounds):
    """{"median_ms", "round_medians_ms", "median_ci_ms", "rel_spread"} of one model's rounds (lists of ms)."""
    _check(rounds, "model_summary")
    pooled = [t for r in rounds for t in r]
    ci = None
    if len(rounds) >= MIN_ROUNDS:
        ci = list(_interval(_resampled_medians(rounds, _draws(len(rounds)))))
    return {
        "median_ms": float(np.median(pooled)) if pooled else None,
        "round_medians_ms": round_medians(rounds),
        "median_ci_ms": ci,
        "rel_spread": rel_spread(rounds),
    }


def _check_paired(caller, numerator_rounds, denominator_rounds, names):
    """Both models' rounds timed (no empty round) and paired (as many of each)."""
    _check(numerator_rounds, f"{caller} ({names[0]})")
    _check(denominator_rounds, f"{caller} ({names[1]})")
    if len(numerator_rounds) != len(denominator_rounds):
        raise ValueError(f"{caller}: {len(numerator_rounds)} {names[0]} rounds but "
                         f"{len(denominator_rounds)} {names[1]} rounds; the rounds must be paired")


def ratio_interval(numerator_rounds, denominator_rounds, names=("numerator", "denominator")):
    """{"low", "high", "level", "method"} of the paired ratio of two models' medians, or None (too few rounds):
    round i of both was timed close together, and each resample draws the same round indices for both."""
    _check_paired("ratio_interval", numerator_rounds, denominator_rounds, names)
    if len(numerator_rounds) < MIN_ROUNDS:
        return None
    draws = _draws(len(numerator_rounds))
    ratios = _resampled_medians(numerator_rounds, draws) / _resampled_medians(denominator_rounds, draws)
    low, high = _interval(ratios)
    return {"low": low, "high": high, "level": LEVEL, "method": METHOD}


PAIRED_METHOD = (f"median over rounds of the ratio of the two round medians (round i of both timed back to back); "
                 f"interval: percentile bootstrap over rounds ({RESAMPLES} resamples, seed {SEED})")


def paired_round_ratio(numerator_rounds, denominator_rounds, names=("numerator", "denominator")):
    """{"ratio", "round_ratios", "interval"}: the median over rounds of round i's median of the numerator over round
    i's median of the denominator, the per-round ratios, and the bootstrap interval over rounds of that median
    ({"low", "high", "level", "method"}, or None with too few rounds). Paired within a round, so a moment of the
    machine that slows both (a host-bound spell of a launch-bound model) cancels, where the ratio of the pooled
    medians takes whichever rounds the spells hit."""
    _check_paired("paired_round_ratio", numerator_rounds, denominator_rounds, names)
    ratios = np.asarray(round_medians(numerator_rounds)) / np.asarray(round_medians(denominator_rounds))
    interval = None
    if len(ratios) >= MIN_ROUNDS:
        low, high = _interval(np.median(ratios[_draws(len(ratios))], axis=1))
        interval = {"low": low, "high": high, "level": LEVEL, "method": PAIRED_METHOD}
    return {"ratio": float(np.median(ratios)), "round_ratios": [float(r) for r in ratios], "interval": interval}


def speedup_interval(reference_rounds, optimized_rounds):
    """{"low", "high", "level", "method"} of reference median / optimized median, or None (too few rounds)."""
    return ratio_interval(reference_rounds, optimized_rounds, ("reference", "optimized"))


def rel_half_width(low, high, point):
    """Half the interval's width as a fraction of the point estimate."""
    return (high - low) / 2.0 / point


def is_noisy(speedup, ci):
    """True when the speedup interval is wider than +-NOISY_HALF_WIDTH; None without an interval."""
    if speedup is None or ci is None:
        return None
    return rel_half_width(ci["low"], ci["high"], speedup) > NOISY_HALF_WIDTH


def summarize(rounds_by_model):
    """Per-model summaries, the speedup, its interval and the noisy flag of {model: rounds}.

    Keys of the result: each model present ("reference", "optimized"), "speedup", "speedup_ci", "noisy"."""
    out = {which: model_summary(rounds) for which, rounds in rounds_by_model.items()}
    speedup = ci = None
    if "reference" in out and "optimized" in out:
        speedup = out["reference"]["median_ms"] / out["optimized"]["median_ms"]
        ci = speedup_interval(rounds_by_model["reference"], rounds_by_model["optimized"])
    out["speedup"] = speedup
    out["speedup_ci"] = ci
    out["noisy"] = is_noisy(speedup, ci)
    return out


def settled_width(rounds_by_model):
    """The relative half-width the stopping rule looks at: of the speedup interval when both models are timed,
    else the widest of the models' median intervals; None while there are too few rounds."""
    if "reference" in rounds_by_model and "optimized" in rounds_by_model:
        ci = speedup_interval(rounds_by_model["reference"], rounds_by_model["optimized"])
        if ci is None:
            return None
        point = (np.median([t for r in rounds_by_model["reference"] for t in r])
                 / np.median([t for r in rounds_by_model["optimized"] for t in r]))
        return rel_half_width(ci["low"], ci["high"], float(point))
    widths = []
    for rounds in rounds_by_model.values():
        summary = model_summary(rounds)
        if summary["median_ci_ms"] is None:
            return None
        low, high = summary["median_ci_ms"]
        widths.append(rel_half_width(low, high, summary["median_ms"]))
    return max(widths) if widths else None
