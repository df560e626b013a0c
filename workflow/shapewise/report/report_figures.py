"""The report's figures (matplotlib, Agg): horizontal bars, one bar per row, sized by the number of rows, so that
they stay readable with 30 rows and more."""

from __future__ import annotations

import math
from pathlib import Path

from shapewise.inputs import paths

ROW_INCHES = 0.32  # height per bar
MIN_HEIGHT = 2.6
FIGURE_DPI = 110
HEATMAP_MAX_WIDTH = 1200 / FIGURE_DPI  # inches: report.html's page width at FIGURE_DPI


def _plt():
    import matplotlib  # deferred: matplotlib, for the figures only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: after matplotlib.use("Agg")

    return plt


def _height(n):
    return max(MIN_HEIGHT, ROW_INCHES * n + 1.4)


def _labels(frame, multi):
    return [f"{i} [M{m}]" if multi else str(i) for i, m in zip(frame["id"], frame["machine_index"])]


def _intervals(ax, ys, lows, highs, **style):
    """Each interval [low, high] as a bar with caps at its own ends, drawn about its midpoint: a speedup may lie
    outside its interval (a ratio of medians against a bootstrap over the rounds' ratios; the report names such
    rows), so the bar is not drawn about the speedup. Intervals with a missing bound are left out."""
    shown = [(y, min(lo, hi), max(lo, hi)) for y, lo, hi in zip(ys, lows, highs)
             if lo is not None and hi is not None and lo == lo and hi == hi]
    if shown:
        ax.errorbar([(lo + hi) / 2 for _, lo, hi in shown], [y for y, _, _ in shown],
                    xerr=[(hi - lo) / 2 for _, lo, hi in shown], fmt="none", ecolor="black", **style)


def speedup(frame, path, multi):
    """Speedup per row with its interval (where known); rows without a speedup are left out."""
    plt = _plt()
    part = frame[frame["speedup"].notna()].iloc[::-1]
    fig, ax = plt.subplots(figsize=(7.5, _height(len(part))))
    ys = list(range(len(part)))
    values = list(part["speedup"])
    colors = ["tab:green" if v >= 1 else "tab:red" for v in values]
    ax.barh(ys, values, color=colors, height=0.7)
    _intervals(ax, ys, part["speedup_ci_low"], part["speedup_ci_high"], elinewidth=1, capsize=3)
    ax.axvline(1.0, color="black", linewidth=0.8)
    if max(values) / max(min(values), 1e-12) > 20:
        ax.set_xscale("log")
    ax.set_yticks(ys, _labels(part, multi), fontsize=8)
    ax.set_xlabel("speedup = reference median / optimized median (bars: 95 % interval)")
    ax.set_title("Speedup per row")
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)


def latency(frame, path, multi):
    """Optimized median against the row's target and the roofline floor (log scale)."""
    plt = _plt()
    part = frame[frame["optimized_median_ms"].notna()].iloc[::-1]
    fig, ax = plt.subplots(figsize=(7.5, _height(len(part))))
    ys = list(range(len(part)))
    ax.barh(ys, list(part["optimized_median_ms"]), color="tab:blue", height=0.7, label="optimized median")
    for column, marker, color, label in (("target_ms", "|", "tab:red", "target"),
                                         ("floor_ms", "x", "black", "roofline floor")):
        pts = [(v, y) for v, y in zip(part[column], ys) if v is not None and v == v]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, s=120, color=color, label=label,
                       zorder=3)
    ax.set_xscale("log")
    ax.set_yticks(ys, _labels(part, multi), fontsize=8)
    ax.set_xlabel("ms per forward (log scale)")
    ax.set_title("Optimized latency against target and roofline floor")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)


def ablation(items, switches, path):
    """Heat map: time with one switch off / all on, one line per row."""
    plt = _plt()
    matrix, notes = [], []
    for item in items:
        by_name = {v["variant"]: v for v in item["data"]["ablation"].get("variants", [])}
        line, note = [], []
        for s in switches:
            v = by_name.get(s, {})
            value = v.get("slowdown_vs_all_on")
            line.append(float(value) if value is not None and "skipped" not in v and "error" not in v else math.nan)
            note.append("err" if "error" in v else "n/a" if v.get("skipped") == "not-applicable"
                        else "skip" if v.get("skipped") else "–")
        matrix.append(line)
        notes.append(note)
    # At most HEATMAP_MAX_WIDTH inches: the page shows the image at its own size (up to 1200 px at FIGURE_DPI),
    # so its labels keep their point size instead of shrinking with a wide figure.
    width = min(HEATMAP_MAX_WIDTH, max(5.5, 0.6 * len(switches) + 3.5))
    fig, ax = plt.subplots(figsize=(width, _height(len(items)) + 1.2))
    image = ax.imshow(matrix, aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(switches)), switches, rotation=45, ha="right", fontsize=10)
    ax.set_yticks(range(len(items)), [i["id"] for i in items], fontsize=10)
    cell_font = 9 if width / max(1, len(switches)) >= 0.55 else 8
    for i, line in enumerate(matrix):
        for j, value in enumerate(line):
            ax.text(j, i, notes[i][j] if value != value else f"{value:.2f}", ha="center", va="center",
                    fontsize=cell_font, color="black" if value != value else "white")  # NaN cells are blank
    fig.colorbar(image, ax=ax, label="time with the switch off / all on")
    ax.set_title("Ablation: slowdown when one optimization is off")
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)


def _by_candidate(frame, candidate_frame, column, multi):
    """(row labels, {candidate: [value or None per row]}) for grouped bars: the rows of `frame` (shapewise's, last
    first), each with shapewise's value and every candidate's on the same row and machine."""
    import pandas as pd  # deferred: pandas, for the grouped bars only

    both = pd.concat([frame, candidate_frame], ignore_index=True)
    both["failed"] = (both["status"] == "fail").astype(float)
    names = list(dict.fromkeys(both["candidate"]))
    rows = frame.iloc[::-1]
    values = {}
    for name in names:
        part = both[both["candidate"] == name].set_index(["id", "machine"])
        values[name] = [None if (i, m) not in part.index or part.loc[(i, m), column] != part.loc[(i, m), column]
                        else float(part.loc[(i, m), column]) for i, m in zip(rows["id"], rows["machine"])]
    return _labels(rows, multi), values


def _grouped_bars(ax, labels, values, failed, errors=None):
    """One group of horizontal bars per label, one bar per candidate (legend), missing values left out; the bar of
    a model that failed the row (failed[name][i]) hatched."""
    names = list(values)
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        ys = [i + (len(names) - 1 - k) * width - 0.4 + width / 2 for i in range(len(labels))]
        shown = [(y, v, bad) for y, v, bad in zip(ys, values[name], failed[name]) if v is not None]
        if not shown:
            continue
        bars = ax.barh([y for y, _, _ in shown], [v for _, v, _ in shown], height=width * 0.9, label=name,
                       color=f"C{k}")
        for bar, (_, _, bad) in zip(bars, shown):
            if bad:
                bar.set_hatch("//")
        if errors is not None:
            lows, highs = errors[name]
            _intervals(ax, ys, [lo if v is not None else None for v, lo in zip(values[name], lows)], highs,
                       elinewidth=0.8, capsize=2)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="hatched: failed the row",
              title_fontsize=7)


def _failed(frame, candidate_frame, multi):
    _, status = _by_candidate(frame, candidate_frame, "failed", multi)
    return {name: [bool(v) for v in values] for name, values in status.items()}


def speedup_by_candidate(frame, candidate_frame, path, multi):
    """Speedup per row of shapewise and of every candidate, each over the reference timed in its own rounds."""
    plt = _plt()
    labels, values = _by_candidate(frame, candidate_frame, "speedup", multi)
    errors = {name: (_by_candidate(frame, candidate_frame, "speedup_ci_low", multi)[1][name],
                     _by_candidate(frame, candidate_frame, "speedup_ci_high", multi)[1][name]) for name in values}
    fig, ax = plt.subplots(figsize=(9, _height(len(labels) * max(1, len(values) // 2))))
    _grouped_bars(ax, labels, values, _failed(frame, candidate_frame, multi), errors)
    ax.axvline(1.0, color="black", linewidth=0.8)
    shown = [v for vs in values.values() for v in vs if v is not None]
    if shown and max(shown) / max(min(shown), 1e-12) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("speedup = reference median / model median, same rounds (bars: 95 % interval)")
    ax.set_title("Speedup per row: shapewise and every candidate")
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)


def latency_by_candidate(frame, candidate_frame, path, multi):
    """Median per row of shapewise and of every candidate (log scale)."""
    plt = _plt()
    labels, values = _by_candidate(frame, candidate_frame, "optimized_median_ms", multi)
    fig, ax = plt.subplots(figsize=(9, _height(len(labels) * max(1, len(values) // 2))))
    _grouped_bars(ax, labels, values, _failed(frame, candidate_frame, multi))
    ax.set_xscale("log")
    ax.set_xlabel("ms per forward (log scale)")
    ax.set_title("Latency per row: shapewise and every candidate")
    fig.tight_layout()
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)


def make_all(frame, items, switches, outdir, candidate_frame=None):
    """Write the figures under outdir/figures; {name: relative path} of those made. With candidates
    (`candidate_frame`, report_candidates.records), the speedup and latency figures show every one of them
    beside shapewise."""
    fig_dir = Path(outdir) / paths.REPORT_FIGURES
    fig_dir.mkdir(parents=True, exist_ok=True)
    multi = frame["machine_index"].nunique() > 1
    made = {}
    with_candidates = candidate_frame is not None and len(candidate_frame) > 0
    if frame["speedup"].notna().any() or (with_candidates and candidate_frame["speedup"].notna().any()):
        if with_candidates:
            speedup_by_candidate(frame, candidate_frame, fig_dir / "speedup.png", multi)
        else:
            speedup(frame, fig_dir / "speedup.png", multi)
        made["speedup"] = f"{paths.REPORT_FIGURES}/speedup.png"
    if frame["optimized_median_ms"].notna().any() or (
            with_candidates and candidate_frame["optimized_median_ms"].notna().any()):
        if with_candidates:
            latency_by_candidate(frame, candidate_frame, fig_dir / "latency.png", multi)
        else:
            latency(frame, fig_dir / "latency.png", multi)
        made["latency"] = f"{paths.REPORT_FIGURES}/latency.png"
    abl = [i for i in items if i["data"]["ablation"].get("status") == "ok"]
    if abl and switches:
        ablation(abl, switches, fig_dir / "ablation.png")
        made["ablation"] = f"{paths.REPORT_FIGURES}/ablation.png"
    return made
