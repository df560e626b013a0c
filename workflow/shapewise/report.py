"""The report job: summary.csv, figures, report.md/.html, provenance.json.

Results are grouped by the machine that produced them (GPU or CPU model plus
a digest of the software, see shapewise.fingerprint.machine_key): each group
gets its own table and geomean, and timings of different machines are never
mixed into one number.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from collections import OrderedDict
from datetime import datetime, timezone
from pathlib import Path

import jinja2

from shapewise import provenance
from shapewise.manifest import load_manifests

TEMPLATES = Path("reports/templates")  # relative: the report job runs in the checkout's root
SOURCE_DIRS = ("model", "kernels", "workflow")
SOURCE_SUFFIXES = (".py", ".smk", ".yaml", ".yml", ".json", ".j2", ".csv", ".toml")
SUMMARY_COLUMNS = ["id", "status", "route", "failed_elements", "total_elements", "max_abs_error",
                   "reference_median_ms", "optimized_median_ms", "speedup"]


def read_json(path):
    with open(path) as fh:
        return json.load(fh)


def geomean(values):
    values = [v for v in values if v and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def fmt(value, digits=3):
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1e4 or abs(value) < 1e-2:
            return f"{value:.{digits}g}"
        return f"{value:.{digits}f}" if abs(value) < 10 else f"{value:.{max(1, digits - 1)}f}"
    return str(value)


def source_inputs():
    files = ["Snakefile", "pyproject.toml", "config/config.yaml"]
    for name in SOURCE_DIRS:
        files += [p.as_posix() for p in sorted(Path(name).rglob("*"))
                  if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts]
    files += [p.as_posix() for p in sorted(TEMPLATES.glob("*"))]
    return [f for f in files if Path(f).is_file()]


def load_shape(shape):
    paths = {
        "preflight": Path(f"results/preflight/{shape}.json"),
        "accuracy": Path(f"results/accuracy/{shape}.json"),
        "timing": Path(f"results/timing/{shape}.json"),
        "profile": Path(f"results/profile/{shape}/kernels.json"),
        "ablation": Path(f"results/ablation/{shape}.json"),
    }
    data = {step: read_json(path) for step, path in paths.items()}
    data["paths"] = paths
    data["profile_csv"] = Path(f"results/profile/{shape}/kernels.csv")
    data["profile_trace"] = Path(f"results/profile/{shape}/trace.json")
    return data


def summary_row(shape, data):
    acc, tim = data["accuracy"], data["timing"]
    official = acc.get("aggregate", {}).get("official", {})
    ref = tim.get("reference") or {}
    opt = tim.get("optimized") or {}
    return OrderedDict(
        id=shape,
        status=acc["status"],
        route=acc.get("route") or tim.get("route") or "",
        failed_elements=official.get("failed_elements"),
        total_elements=official.get("total_elements"),
        max_abs_error=official.get("max_abs_error"),
        reference_median_ms=ref.get("median_ms"),
        optimized_median_ms=opt.get("median_ms"),
        speedup=tim.get("speedup"),
    )


def machine_of(data):
    env = data["timing"]["environment"]
    return env["machine_key"], env


def chunked_notes(rows):
    notes = []
    for row in rows:
        acc = row["data"]["accuracy"]
        if acc.get("check_method") != "chunked":
            continue
        checked = acc["trials"][0]["checked"]
        notes.append({
            "id": row["id"],
            "trials": len(acc["trials"]),
            "batch_indices": checked["batch_indices"],
            "query_ranges": checked["query_ranges"],
            "elements_compared": checked["elements_compared"],
            "elements_total": checked["elements_total"],
            "reference": checked["reference"],
            "batch_size": row["data"]["accuracy"]["row"]["batch_size"],
        })
    return notes


# ------------------------------------------------------------------ figures


def figures(groups, outdir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = {}
    fig_dir = outdir / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)

    timed = [(g, r) for g in groups for r in g["rows"] if r["summary"]["speedup"]]
    if timed:
        fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(timed) + 2), 4))
        labels = [r["id"] + ("" if len(groups) == 1 else f" [{g['index']}]") for g, r in timed]
        colors = ["tab:green" if r["summary"]["speedup"] >= 1 else "tab:red" for _, r in timed]
        ax.bar(range(len(timed)), [r["summary"]["speedup"] for _, r in timed], color=colors)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(timed)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("speedup (reference median / optimized median)")
        ax.set_title("Speedup per shape")
        fig.tight_layout()
        fig.savefig(fig_dir / "speedup.png", dpi=120)
        plt.close(fig)
        made["speedup"] = "figures/speedup.png"

    roof = [(g, r) for g in groups for r in g["rows"]
            if r["data"]["timing"].get("roofline", {}).get("available") and r["summary"]["optimized_median_ms"]]
    if roof:
        fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(roof) + 2), 4))
        xs = range(len(roof))
        ax.bar([x - 0.2 for x in xs], [r["summary"]["optimized_median_ms"] for _, r in roof], width=0.4,
               label="optimized median")
        ax.bar([x + 0.2 for x in xs], [r["data"]["timing"]["roofline"]["floor_ms"] for _, r in roof], width=0.4,
               label="roofline floor")
        ax.set_yscale("log")
        ax.set_xticks(list(xs), [r["id"] for _, r in roof], rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("ms per forward")
        ax.set_title("Latency against the roofline floor")
        ax.legend()
        fig.tight_layout()
        fig.savefig(fig_dir / "roofline.png", dpi=120)
        plt.close(fig)
        made["roofline"] = "figures/roofline.png"

    abl_rows = [r for g in groups for r in g["rows"] if r["data"]["ablation"].get("status") == "ok"]
    switches = abl_rows[0]["data"]["ablation"]["switches"] if abl_rows else []
    if abl_rows and switches:
        matrix, labels = [], []
        for r in abl_rows:
            by_name = {v["variant"]: v for v in r["data"]["ablation"]["variants"]}
            matrix.append([by_name.get(s, {}).get("slowdown_vs_all_on", float("nan")) for s in switches])
            labels.append(["n/a" if by_name.get(s, {}).get("skipped") == "not-applicable" else
                           "skip" if by_name.get(s, {}).get("skipped") else "err" for s in switches])
        fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(switches) + 3), max(3, 0.35 * len(abl_rows) + 1.5)))
        image = ax.imshow(matrix, aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(switches)), switches, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(abl_rows)), [r["id"] for r in abl_rows], fontsize=8)
        for i, line in enumerate(matrix):
            for j, value in enumerate(line):
                text = labels[i][j] if value != value else f"{value:.2f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white")
        fig.colorbar(image, ax=ax, label="time with the switch off / all on")
        ax.set_title("Ablation: slowdown when one optimization is off")
        fig.tight_layout()
        fig.savefig(fig_dir / "ablation.png", dpi=120)
        plt.close(fig)
        made["ablation"] = "figures/ablation.png"
    return made


# ------------------------------------------------------------------ main


def copy_into(src, outdir, rel):
    dst = outdir / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return rel


def main(args):
    outdir = Path(args.outdir)
    for stale in ("data", "figures"):
        shutil.rmtree(outdir / stale, ignore_errors=True)
    outdir.mkdir(parents=True, exist_ok=True)
    shapes = [s for s in args.shapes.split(",") if s]
    manifests = [m for m in args.manifests.split(",") if m]
    manifest_rows = {r["id"]: r for r in load_manifests(manifests)}
    artifacts = []

    env_fp = read_json("results/fingerprint/environment.json")
    impl_fp = read_json("results/fingerprint/implementation.json")
    microbench = read_json("results/microbench/microbench.json")
    for src, rel in (("results/fingerprint/environment.json", "data/fingerprint/environment.json"),
                     ("results/fingerprint/implementation.json", "data/fingerprint/implementation.json"),
                     ("results/microbench/microbench.json", "data/microbench/microbench.json")):
        artifacts.append(copy_into(src, outdir, rel))

    groups = OrderedDict()
    for shape in shapes:
        data = load_shape(shape)
        for step, path in data["paths"].items():
            name = f"data/{step}/{shape}.json" if step != "profile" else f"data/profile/{shape}/kernels.json"
            artifacts.append(copy_into(path, outdir, name))
        artifacts.append(copy_into(data["profile_csv"], outdir, f"data/profile/{shape}/kernels.csv"))
        key, env = machine_of(data)
        group = groups.setdefault(key, {"key": key, "environment": env, "rows": [], "hosts": set()})
        group["hosts"].add(env.get("host"))
        group["rows"].append({"id": shape, "row": manifest_rows[shape], "data": data,
                              "summary": summary_row(shape, data)})

    group_list = []
    for index, group in enumerate(groups.values(), 1):
        rows = group["rows"]
        statuses = [r["summary"]["status"] for r in rows]
        speedups = [r["summary"]["speedup"] for r in rows if r["summary"]["speedup"]]
        group.update(
            index=index,
            hosts=sorted(h for h in group["hosts"] if h),
            is_cpu=group["environment"].get("gpu_name") is None,
            geomean_speedup=geomean(speedups),
            timed_rows=len(speedups),
            passed=statuses.count("pass"),
            failed=statuses.count("fail"),
            skipped=statuses.count("resource-skip"),
            elements=sum(r["summary"]["total_elements"] or 0 for r in rows),
            failed_elements=sum(r["summary"]["failed_elements"] or 0 for r in rows),
        )
        group_list.append(group)

    all_rows = [r for g in group_list for r in g["rows"]]
    with open(outdir / "summary.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=SUMMARY_COLUMNS)
        writer.writeheader()
        for r in all_rows:
            writer.writerow(r["summary"])
    artifacts.append("summary.csv")

    made = figures(group_list, outdir)
    artifacts += list(made.values())

    ablation_switches = []
    for r in all_rows:
        if r["data"]["ablation"].get("switches"):
            ablation_switches = r["data"]["ablation"]["switches"]
            break

    inputs = sorted(set(manifests + source_inputs()))
    timing_protocol, ablation_protocol, protocol_exceptions = protocols(all_rows)
    context = {
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_run": any(g["is_cpu"] for g in group_list),
        "groups": group_list,
        "mixed_machines": len(group_list) > 1,
        "rows": all_rows,
        "counts": {s: sum(r["summary"]["status"] == s for r in all_rows) for s in ("pass", "fail", "resource-skip")},
        "elements": sum(g["elements"] for g in group_list),
        "failed_elements": sum(g["failed_elements"] for g in group_list),
        "manifests": manifests,
        "figures": made,
        "microbench": microbench,
        "environment_fingerprint": env_fp,
        "implementation": impl_fp,
        "chunked": chunked_notes(all_rows),
        "ablation_switches": ablation_switches,
        "timing_protocol": timing_protocol,
        "ablation_protocol": ablation_protocol,
        "protocol_exceptions": protocol_exceptions,
        "profile_kernels": {r["id"]: r["data"]["profile"].get("triton_kernels_ran", []) for r in all_rows},
        "traces": {r["id"]: r["data"]["profile_trace"].as_posix() for r in all_rows},
        "inputs": [provenance._entry(p, ".") for p in inputs],
        "artifacts_listed": [provenance._entry(p, outdir) for p in sorted(set(artifacts))],
        "fmt": fmt,
    }
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             autoescape=jinja2.select_autoescape(["html"]), trim_blocks=True, lstrip_blocks=True)
    env.filters["fmt"] = fmt
    (outdir / "report.md").write_text(env.get_template("report.md.j2").render(**context))
    (outdir / "report.html").write_text(env.get_template("report.html.j2").render(**context))
    artifacts += ["report.md", "report.html"]
    provenance.write(outdir, inputs, artifacts, root=".")
    print(f"report: {len(all_rows)} shapes in {len(group_list)} machine group(s); "
          f"pass {context['counts']['pass']}, fail {context['counts']['fail']}, "
          f"resource-skip {context['counts']['resource-skip']}")
    return 0


def protocols(rows):
    """The timing and ablation protocol most rows ran, and the rows that ran another one (heavy rows)."""
    def common(step):
        seen = [json.dumps(r["data"][step].get("protocol"), sort_keys=True) for r in rows
                if r["data"][step].get("protocol")]
        return max(set(seen), key=seen.count) if seen else None

    out, exceptions = [], []
    for step in ("timing", "ablation"):
        usual = common(step)
        out.append(json.loads(usual) if usual else None)
        for r in rows:
            p = r["data"][step].get("protocol")
            if p and json.dumps(p, sort_keys=True) != usual:
                exceptions.append({"id": r["id"], "step": step, "protocol": p})
    return out[0], out[1], exceptions
