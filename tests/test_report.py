"""The report built from hand-made result files (no Snakemake, no models): identity checks, damaged files, the
previous report kept on failure, a resource-skip row, summary.csv's columns, the baseline section.

`make_run` is also used by tests/test_browser.py."""

import copy
import csv
import json
import re
import shutil
from pathlib import Path

import pytest
from checkout import copy_checkout
from shapewise.inputs import paths
from shapewise.provenance import identity, provenance
from shapewise.report import report, report_data

IMPL = "a" * 64
ENV = "e" * 64
MACHINE = "NVIDIA H200 | software 7e5f54b6e272"


def _row(rid, batch, seq, d, target=None, pass_mask=True):
    row = {"id": rid, "batch_size": batch, "seq_len": seq, "d_model": d, "num_heads": 4, "ffn_dim": 4 * d,
           "num_layers": 2, "causal": True, "dtype": "float32", "padding_ratio": 0.0, "input_scale": 1.0,
           "trials": 2, "route": "auto", "mask": "none", "pass_mask": pass_mask}
    if target is not None:
        row["target_ms"] = target
    return row


ENVIRONMENT = {"machine_key": MACHINE, "gpu_name": "NVIDIA H200", "gpu_count": 2, "host": "node1",
               "cpu": "Intel(R) Xeon(R) Processor", "cpu_count": 16, "driver": "580.1", "cuda_runtime": "13.0",
               "torch_full": "2.11.0+cu130", "triton": "3.6.0", "python": "3.12.3", "package_count": 244,
               "packages_sha256": "1" * 64}
ROUTE = {"name": "fused", "precision": "fp16", "reason": "short, narrow, launch-bound shape: one kernel per layer "
         "(tokens*d = 2097152), which is a long sentence that must not widen the table", "forced": False,
         "attention": "triton", "launch": [32, 4, 2], "kv_precompute": True, "chunk": None}
LABEL = "fused/fp16 launch=(32, 4, 2) kv=precomputed"  # Route.__str__ of ROUTE without its reason
ROUTE_STR = (f"{LABEL} (auto: short, narrow, launch-bound shape: one kernel per "
             "layer (tokens*d = 2097152), which is a long sentence that must not widen the table)")
SWITCHES = ["fused_layer", "cuda_graph", "kv_precompute"]
# The host records of a stable timing run on an H200 virtual machine (a real result: row official-06 of an H200 run,
# `allowed` shortened); the 'timed' rows carry them, the 'old-timing' rows predate them.
CPU_AFFINITY = {"requested": "per-slot", "allowed": list(range(32)), "cores": list(range(16)), "applied": True,
                "reason": "slot 1 of 2: pinned to 16 of 32 physical cores (16 of 32 logical CPUs)",
                "topology": "sysfs", "physical_cores": 16, "torch_threads": 2}
CORE_PICK = {"method": "fastest-launch", "probe_launches": 200, "cores": list(range(16)), "rounds": [
    {"core": 4, "cores_probed": 16, "launch_us": 6.304, "median_launch_us": 6.661},
    {"core": 9, "cores_probed": 16, "launch_us": 6.631, "median_launch_us": 7.51},
    {"core": 9, "cores_probed": 16, "launch_us": 6.048, "median_launch_us": 6.523},
    {"core": 9, "cores_probed": 16, "launch_us": 6.138, "median_launch_us": 6.567},
    {"core": 9, "cores_probed": 16, "launch_us": 6.158, "median_launch_us": 7.022},
    {"core": 4, "cores_probed": 16, "launch_us": 6.263, "median_launch_us": 6.818}]}


def _header(step, row):
    return {"step": step, "shape": row["id"] if row else None, "row": row, "device": "cuda",
            "environment": ENVIRONMENT, "started": "2026-11-30T10:00:00+00:00",
            "finished": "2026-11-30T10:00:05+00:00", "identity": identity.identity(row, IMPL, ENV)}


def _model(median, spread=0.01, peak=None, with_ci=True):
    rounds = [median * (1 - spread / 2), median, median * (1 + spread / 2)]
    out = {"median_ms": median, "p90_ms": median * 1.02, "min_ms": median * 0.98, "first_call_ms": 900.0,
           "peak_memory_bytes": peak, "tokens_per_s": 1e7, "times_ms": rounds}
    if with_ci:
        out.update(round_medians_ms=rounds, median_ci_ms=[rounds[0], rounds[2]], rel_spread=rounds[2] / rounds[0] - 1)
    return out


def _results(row, kind):
    """{step: result} of one row: kind 'timed' (every new field), 'old-timing' (no interval/gpu/contention fields:
    an older timing job, identity present) or 'skip' (nothing fits)."""
    io = 2 * row["batch_size"] * row["seq_len"] * row["d_model"] * 4
    pre = _header("preflight", row)
    fits = kind != "skip"
    pre.update(budget_bytes=10**9, models={m: {"dtype": "float32", "estimate_bytes": 10**6 if fits else 10**15,
                                              "fits": fits} for m in ("reference", "optimized")})
    acc = _header("accuracy", row)
    tim = _header("timing", row)
    tim.update(protocol={"name": "official", "warmup": 20, "rounds": 3, "calls": 100, "timer": "cuda events per call",
                         "float32_matmul_precision": "high"}, skips={}, call="model(x, mask)")
    prof = _header("profile", row)
    abl = _header("ablation", row)
    if kind == "skip":
        reason = "optimized model needs ~1000000000000000 bytes, budget 1000000000 bytes"
        acc.update(status="resource-skip", skip_reason=reason)
        tim["skips"] = {m: "resource skip: estimated 1000000000000000 bytes > budget 1000000000 bytes"
                        for m in ("reference", "optimized")}
        # as the timing job writes a resource skip: nothing built, nothing timed
        tim.update(status="resource-skip", call=None, speedup=None, speedup_ci=None, noisy=None, gpu=None,
                   contention={"checked": False, "other_processes": [], "contended": False, "reason": "skip"},
                   roofline={"available": False, "reason": "resource skip: the optimized model does not fit"})
        prof.update(status="resource-skip", triton_kernels_ran=[])
        abl.update(status="resource-skip")
        return {"preflight": pre, "accuracy": acc, "timing": tim, "profile": prof, "ablation": abl}
    comparison = {"failed_elements": 0, "max_abs_error": 0.0012, "max_rel_error": 3.0, "passed": True,
                  "total_elements": row["batch_size"] * row["seq_len"] * row["d_model"] * 2, "trials_passed": 2}
    acc.update(status="pass", check_method="full", route=ROUTE_STR, route_detail=ROUTE,
               aggregate={"official": comparison, "strict": dict(comparison, failed_elements=3, passed=False)})
    ref_ms, opt_ms = (2.2, 0.23) if row["id"].endswith("1") else (1.4, 0.6)
    tim.update(route=ROUTE_STR, route_detail=ROUTE, reference=_model(ref_ms, peak=3 * io, with_ci=kind == "timed"),
               optimized=_model(opt_ms, spread=0.2, peak=int(1.6 * io), with_ci=kind == "timed"),
               speedup=ref_ms / opt_ms,
               roofline={"available": True, "floor_ms": 0.02, "fraction_of_floor": 0.02 / opt_ms})
    if kind == "timed":
        tim["protocol"] = {"name": "stable", "warmup": 20, "calls": 50, "rounds": None, "min_rounds": 6,
                           "max_rounds": 30, "ci_half_width": 0.02, "timer": "cuda events per call",
                           "float32_matmul_precision": "high", "cpus": "per-slot", "core_pick": "fastest-launch"}
        tim["stopping"] = {"rounds_run": 9, "reason": "settled"}
        # the all-True mask costs 4.5 % here: over the 3 % limit
        tim["mask_cost"] = {"measured": True, "limit": 0.03, "call": "model(x)", "ratio": 1.045,
                            "ratio_ci": {"low": 1.03, "high": 1.06, "level": 0.95, "method": "bootstrap"},
                            "within_limit": False, "unmasked_median_ms": opt_ms / 1.045,
                            "unmasked_ci_ms": [opt_ms / 1.06, opt_ms / 1.03]}
        tim.update(cpu_affinity=copy.deepcopy(CPU_AFFINITY), core_pick=copy.deepcopy(CORE_PICK))
        tim.update(speedup_ci={"low": ref_ms / opt_ms * 0.9, "high": ref_ms / opt_ms * 1.12, "level": 0.95,
                               "method": "bootstrap"}, noisy=True,
                   gpu={"index": 1, "uuid": "GPU-0123456789abcdef", "name": "NVIDIA H200", "slot": 1,
                        "slot_source": "lock", "cuda_visible_devices": "1"},
                   contention={"checked": True, "contended": True,
                               "other_processes": [{"pid": 4242, "name": "python", "used_memory_bytes": 2**30}]})
    prof.update(status="ok", triton_kernels_ran=["_fused_layer_fwd"],
                gpu_shared_during_capture=["warmup results/warmup/t-09.json"] if kind == "timed" else [])
    variants = [{"variant": "all-on", "disable": [], "median_ms": opt_ms, "slowdown_vs_all_on": 1.0, "passed": True}]
    variants += [{"variant": s, "disable": [s], "median_ms": opt_ms * 1.5, "slowdown_vs_all_on": 1.5, "passed": True}
                 for s in SWITCHES[:2]]
    variants.append({"variant": SWITCHES[2], "disable": [SWITCHES[2]], "skipped": "not-applicable", "reason": "x"})
    abl.update(status="ok", switches=SWITCHES, variants=variants,
               protocol={"warmup": 5, "rounds": 1, "calls": 30})
    return {"preflight": pre, "accuracy": acc, "timing": tim, "profile": prof, "ablation": abl}


def write_json(path, data):
    """Write `data`; a result (a record with a `step`) is sealed with its content digest as its job would seal it."""
    if isinstance(data, dict) and "step" in data:
        data = provenance.seal(json.loads(json.dumps(data)))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


ROWS = [(_row("t-01", 128, 128, 128, target=0.06), "timed"),
        (_row("t-02", 8, 512, 256, target=0.4), "old-timing"),
        (_row("t-03", 100_000_000, 1024, 1024), "skip")]


def make_run(root, rows=ROWS):
    """Write a results tree under root (the working directory of the report) and return the inputs dict the
    report rule would write. Paths are relative to root, as in a pipeline run."""
    root = Path(root)
    write_json(root / paths.FINGERPRINTS["env"], dict(_header("fingerprint", None), kind="environment",
                                                      dag_digest=ENV, digest="f" * 64))
    write_json(root / paths.FINGERPRINTS["impl"], {"step": "fingerprint", "kind": "implementation", "digest": IMPL,
                                                   "files": {}})
    micro = _header("microbench", None)
    micro.update({"copy": {"gb_per_s": 4183.0, "counting": "bytes read + bytes written"},
                  "gemm": {"fp16": {"tflop_per_s": 752.3, "n": 8192}},
                  "launch": {"eager_us_per_launch": 7.5, "graph_us_per_kernel": 0.95}})
    write_json(root / paths.MICROBENCH, micro)
    entries = []
    for row, kind in rows:
        for step, data in _results(row, kind).items():
            write_json(root / paths.result(step, row["id"]), data)
        extra = paths.profile_extra(row["id"])
        (root / extra["csv"]).write_text("kernel,calls\n_fused_layer_fwd,2\n")
        entries.append({"row": row, "results": paths.per_shape(row["id"]), "profile_csv": extra["csv"],
                        "profile_trace": extra["trace"]})
    (root / "shapes").mkdir(exist_ok=True)
    (root / "shapes" / "test.yaml").write_text("# the rows are in the inputs\n")
    return {"rows": entries, "manifests": ["shapes/test.yaml"], "fingerprints": dict(paths.FINGERPRINTS),
            "microbench": paths.MICROBENCH, "environment_digest": ENV, "baseline": None, "pass_env": {},
            "root": "."}


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return make_run(tmp_path)


def _refused(inputs, outdir="results/report"):
    with pytest.raises(report_data.ReportInputError) as info:
        report.render(inputs, outdir)
    return str(info.value)


def test_report_renders_every_row_and_summary_columns(run):
    context = report.render(run, "results/report")
    out = Path("results/report")
    for name in ("report.md", "report.html", "summary.csv", "provenance.json", "figures/speedup.png",
                 "figures/latency.png", "figures/ablation.png", "data/timing/t-01.json"):
        assert (out / name).is_file(), name
    with open(out / "summary.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == report_data.SUMMARY_COLUMNS
        rows = {r["id"]: r for r in reader}
    assert list(rows) == ["t-01", "t-02", "t-03"]
    t1, t2, t3 = rows["t-01"], rows["t-02"], rows["t-03"]
    assert t1["machine"] == MACHINE and t1["status"] == "pass" and t1["call"] == "model(x, mask)"
    assert t1["route"] == LABEL
    assert float(t1["speedup_ci_low"]) < float(t1["speedup"]) < float(t1["speedup_ci_high"])
    assert t1["noisy"] == "true" and t1["target_met"] == "false"
    assert int(t1["io_bytes"]) == 2 * 128 * 128 * 128 * 4 and int(t1["strict_failed_elements"]) == 3
    assert t2["speedup_ci_low"] == "" and t2["noisy"] == "" and t2["reference_ci_low_ms"] == ""
    assert t3["status"] == "resource-skip" and t3["optimized_median_ms"] == "" and t3["route"] == ""
    assert t3["target_met"] == ""
    assert float(t1["mask_cost"]) == pytest.approx(0.045) and float(t1["mask_cost_ci_low"]) == pytest.approx(0.03)
    assert float(t1["unmasked_median_ms"]) == pytest.approx(0.23 / 1.045)
    assert t2["mask_cost"] == "" and t3["mask_cost"] == ""  # t-02 predates the measurement, t-03 did not run
    assert context["counts"] == {"pass": 2, "fail": 0, "resource-skip": 1}

    html = (out / "report.html").read_text()
    md = (out / "report.md").read_text()
    assert "resource-skip" in html and "t-03" in html
    text = re.sub(r"<[^>]+>", "", re.sub(r"(?s)<style>.*?</style>", "", html))
    joined = re.findall(r".{0,20}(?:[a-z]\.[A-Z][a-z]|%\)[a-z]).{0,20}", text)  # a sentence across the template's
    assert not joined, joined  # lines keeps its space ("target.The", "%)of")
    # a profile captured beside another job on its GPU says its kernel times are upper bounds; the others do not
    shared = "captured beside 1 other job(s) on its GPU: its kernel times are upper bounds"
    assert f"- t-01: \\_fused_layer_fwd ({shared})\n- t-02: " in md and md.count(shared) == 1
    assert html.count(shared) == 1
    # the route's label in the tables, the full sentence one hover away
    assert f">{LABEL}</a>" in html and f'title="{ROUTE_STR}"' in html
    assert f"| pass | {LABEL} | 0 / 4194304 |" in md
    assert "model(x, mask)" in html and "contended" in html and "GPU 1 (slot 1, lock)" in html
    assert "noisy" in html and "missed" in html
    assert "stable, 9 rounds (settled)" in html and "stable, 9 rounds (settled)" in md
    # the all-True mask's cost: its table row, the verdict against the limit, the summary sentence
    assert "| t-01 | 0.230 | 0.220 | +4.5 % [+3.0 %, +6.0 %] | **no** |" in md
    md_flat, html_flat = " ".join(md.split()), " ".join(html.split())  # sentences wrap where the template does
    assert "at most +4.5 % against no mask; within 3.0 % on 0 of 1 row(s)" in md_flat
    assert "+4.5 % [+3.0 %, +6.0 %]" in html and "within 3.0 % on 0 of 1 row(s)" in html_flat
    assert "| t-02 | n/a | n/a | n/a (not measured (a result older than the check)) | n/a |" in md
    assert "between 6 and 30" in html or "6–30" in html
    for text in (html, md):
        # tolerances come from the code, not from typed numbers
        from shapewise.model.tolerance import TOLERANCES

        assert f"atol {TOLERANCES['official']['atol']}" in text
        assert "n/a" in text  # t-02 has no interval


def _host_cpu_lines(text, marker):
    """The lines of `text` that hold `marker` (a row id) in the host-CPU section (up to the next heading)."""
    section = text.split(report_data.HOST_CPUS_HEADING, 1)[1].split("\n## ", 1)[0].split("<h2", 1)[0]
    return [line for line in section.splitlines() if marker in line]


def test_cores_and_core_pick_per_row(run):
    """A result with cpu_affinity and core_pick shows its cores and the picked core's launch cost per row; a result
    written before the records says "not recorded"; the method sentence appears because a row used the pick."""
    report.render(run, "results/report")
    out = Path("results/report")
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    # medians over the 6 rounds: picked 6.2105 µs, all cores 6.7395 µs; cores 4 and 9
    picked = ("fastest-launch: picked core launch 6.2 µs (median over rounds; all cores' median 6.7 µs), "
              "6 rounds on 2 cores")
    cores = "16 logical CPUs (16 physical, sysfs), 2 torch threads"
    for text in (md, html):
        [t1] = _host_cpu_lines(text, "t-01:") if text is md else _host_cpu_lines(text, 'id="cpus-t-01"')
        assert cores in t1 and picked in t1 and CPU_AFFINITY["reason"] in t1, t1
        [t2] = _host_cpu_lines(text, "t-02:") if text is md else _host_cpu_lines(text, 'id="cpus-t-02"')
        assert "cores: not recorded; core pick: not recorded" in t2, t2
        [t3] = _host_cpu_lines(text, "t-03:") if text is md else _host_cpu_lines(text, 'id="cpus-t-03"')
        assert "not timed (resource skip)" in t3, t3
        assert "Core pick (fastest-launch): before every timed round" in text
        assert "each core timed over 200 launches" in text
    # the main tables stay as narrow as before: nothing of this in the timing or resources table
    timing_table = html.split('<table class="timing">', 1)[1].split("</table>", 1)[0]
    resources_table = html.split('<table class="resources">', 1)[1].split("</table>", 1)[0]
    assert "logical CPUs" not in timing_table + resources_table and "fastest-launch" not in timing_table
    with open(out / "summary.csv", newline="") as fh:
        assert csv.DictReader(fh).fieldnames == report_data.SUMMARY_COLUMNS


def test_no_core_pick_sentence_when_no_row_used_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inputs = make_run(tmp_path, rows=[(_row("t-02", 8, 512, 256), "old-timing")])
    report.render(inputs, "results/report")
    for name in ("report.md", "report.html"):
        text = (tmp_path / "results/report" / name).read_text()
        assert "Core pick (fastest-launch)" not in text and "not recorded" in text


def test_host_cpu_labels():
    official = {"cpu_affinity": {"requested": None, "applied": False,
                                 "reason": "official protocol: cores left as they were"}, "core_pick": None}
    assert report_data.cores_label(official) == "not pinned"
    assert report_data.core_pick_label(official) == "none"
    unknown = {"cpu_affinity": dict(CPU_AFFINITY, cores=[3], physical_cores=1, torch_threads=None,
                                    topology="unknown: /sys/devices/system/cpu not readable")}
    assert report_data.cores_label(unknown) == "1 logical CPU (1 physical, unknown: /sys/devices/system/cpu not " \
                                               "readable)"
    assert report_data.core_pick_label({}) == "not recorded" == report_data.cores_label({})
    one = {"core_pick": dict(CORE_PICK, rounds=CORE_PICK["rounds"][:1])}
    assert report_data.core_pick_label(one) == ("fastest-launch: picked core launch 6.3 µs (median over rounds; "
                                                "all cores' median 6.7 µs), 1 round on 1 core")
    assert report_data.core_pick_note([official, {}]) is None
    assert "200 launches" in report_data.core_pick_note([official, {"core_pick": CORE_PICK}])


def test_rows_stopped_on_the_time_budget_are_marked_and_counted(tmp_path, monkeypatch):
    """A stable row stopped by max_seconds shows `time` and its budget where its rounds are shown; the method
    section counts the rows that stopped on time apart from those that settled and those at the cap."""
    monkeypatch.chdir(tmp_path)
    rows = [(_row(f"t-0{i}", 128, 128, 128), "timed") for i in range(1, 5)]
    inputs = make_run(tmp_path, rows=rows)
    stops = {"t-02": {"rounds_run": 11, "reason": "time"}, "t-03": {"rounds_run": 8, "reason": "time"},
             "t-04": {"rounds_run": 30, "reason": "cap"}}
    for row, _ in rows:
        timing = _results(row, "timed")["timing"]
        timing["protocol"]["max_seconds"] = 3
        timing["stopping"] = dict(stops.get(row["id"], timing["stopping"]), max_seconds=3)
        write_json(tmp_path / paths.result("timing", row["id"]), timing)
    report.render(inputs, "results/report")
    md = (tmp_path / "results/report/report.md").read_text()
    html = (tmp_path / "results/report/report.html").read_text()
    for text in (md, " ".join(html.split())):
        flat = " ".join(text.split())
        assert "stable, 11 rounds (time: 3 s)" in flat and "stable, 8 rounds (time: 3 s)" in flat
        assert "stable, 30 rounds (cap)" in flat and "stable, 9 rounds (settled)" in flat
        assert ("Stopping (stable protocol), 4 rows timed: 1 stopped once the speedup's interval settled, 2 on the "
                "time budget (max_seconds 3 s of rounds a row) before it settled, 1 at the round cap") in flat
        assert "before a round that would take the rounds past 3 s" in flat


def test_the_method_names_the_bound_of_a_rounds_calls(tmp_path, monkeypatch):
    """Where the timing protocol sets round_seconds, the method section says a slow model's round is cut to what
    fits in it, at least min_calls; without it (results of a protocol without the bound) it says nothing of it."""
    monkeypatch.chdir(tmp_path)
    rows = [(_row(f"t-0{i}", 128, 128, 128), "timed") for i in range(1, 3)]
    inputs = make_run(tmp_path, rows=rows)
    clause = "a model whose calls are slow: as many as fit in 0.5 s, at least 10, its time a call estimated from its"
    for bound, shown in (({"round_seconds": 0.5, "min_calls": 10}, True), ({}, False)):
        for row, _ in rows:
            timing = _results(row, "timed")["timing"]
            timing["protocol"].update(bound)
            write_json(tmp_path / paths.result("timing", row["id"]), timing)
        shutil.rmtree(tmp_path / "results/report", ignore_errors=True)
        report.render(inputs, "results/report")
        for name in ("report.md", "report.html"):
            flat = " ".join((tmp_path / "results/report" / name).read_text().split())
            assert (clause in flat) is shown, (name, bound)


def test_stopping_note():
    official = {"protocol": {"name": "official"}, "stopping": {"rounds_run": 3, "reason": "fixed"}}
    assert report_data.stopping_note([official, {}]) is None
    older = {"protocol": {"name": "stable"}, "stopping": {"rounds_run": 30, "reason": "cap"}}  # before max_seconds
    assert report_data.stopping_note([official, older]) == (
        "Stopping (stable protocol), 1 row timed: 0 stopped once the speedup's interval settled, 0 on the time "
        "budget (no time budget set) before it settled, 1 at the round cap; a row stopped on time or at the cap has "
        "the interval it reached, shown in its timing row.")


def test_tolerances_are_not_typed_into_the_templates():
    from shapewise.model.tolerance import TOLERANCES

    for template in paths.TEMPLATES.glob("*.j2"):
        text = template.read_text()
        for tol in TOLERANCES.values():
            for value in tol.values():
                assert f"{value:g}" not in text.replace("2·B·S·d", ""), (template, value)


def test_route_label_is_the_models_string_without_its_reason():
    """The label is what Route.__str__ wrote, so every field that changes what runs is in it (a two-program,
    prepared Hopper launch is not shown as plain `hopper`)."""
    from dataclasses import fields

    from shapewise.model.routing import Route

    assert report_data.route_label(ROUTE_STR) == LABEL
    hopper = Route("hopper", "bf16", "wide rows (tokens > 4096): hopper attention", attention="hopper", eager=True,
                   pair=True, prepared_launch=True, direct_launch=True)
    label = report_data.route_label(str(hopper))
    assert label == "hopper/bf16+hopper-attention pair eager prepared-launch direct-launch"
    # every boolean field of Route that is on shows in the label: none is dropped as the model adds fields
    plain = Route("graph", "fp16", "r")
    for field in fields(Route):
        if field.type in ("bool", bool) and field.name != "forced":
            on = report_data.route_label(str(Route(**{**plain.as_dict(), "launch": (), field.name: True})))
            assert on != report_data.route_label(str(plain)), field.name
    assert report_data.route_label(str(Route("reference", "fp32", "asked (by the row)", forced=True))) == \
        "reference/fp32 (forced)"
    assert report_data.route_label("a route string of another form") == "a route string of another form"
    assert report_data.route_label(None) is None
    # a row the timing job did not route: the accuracy trials' routes, each labelled
    assert report_data.routes_of({}, {"routes": ["a/fp16 (auto: x)", "b/fp16 (auto: y)"]}) == \
        ["a/fp16 (auto: x)", "b/fp16 (auto: y)"]


def test_foreign_result_is_refused_by_file_name(run):
    # another row's valid timing copied into t-01's place
    shutil.copyfile(paths.result("timing", "t-02"), paths.result("timing", "t-01"))
    message = _refused(run)
    assert paths.result("timing", "t-01") in message
    assert "row_id is 't-02', expected 't-01'" in message
    assert "--forcerun $(shapewise targets t-01)" in message
    assert not Path("results/report").exists()


def test_result_of_another_implementation_is_refused(run):
    path = paths.result("accuracy", "t-02")
    data = json.loads(Path(path).read_text())
    data["identity"]["implementation_digest"] = "b" * 64
    write_json(path, data)
    message = _refused(run)
    assert path in message and "implementation_digest" in message


def test_row_changed_since_the_result_is_refused(run):
    changed = copy.deepcopy(run)
    changed["rows"][0]["row"]["seq_len"] = 256
    message = _refused(changed)
    assert "row_digest" in message and paths.result("preflight", "t-01") in message


def test_result_without_identity_is_refused_as_predating_it(run):
    path = paths.result("profile", "t-01")
    data = json.loads(Path(path).read_text())
    del data["identity"]
    write_json(path, data)
    message = _refused(run)
    assert path in message and "predates" in message and "shapewise targets t-01" in message


def test_truncated_result_is_named_with_the_command(run):
    path = Path(paths.result("timing", "t-01"))
    path.write_text(path.read_text()[:200])
    message = _refused(run)
    assert str(path) in message and "not valid JSON" in message
    assert "snakemake --cores all --forcerun $(shapewise targets t-01)" in message
    assert "JSONDecodeError" not in message


def test_missing_result_is_named(run):
    Path(paths.result("ablation", "t-02")).unlink()
    message = _refused(run)
    assert paths.result("ablation", "t-02") in message and "missing" in message


def test_every_bad_file_is_named_at_once(run):
    Path(paths.result("ablation", "t-02")).unlink()
    Path(paths.result("timing", "t-01")).write_text("{")
    message = _refused(run)
    assert paths.result("ablation", "t-02") in message and paths.result("timing", "t-01") in message


def test_failed_report_keeps_the_previous_one(run, capsys):
    report.render(run, "results/report")
    out = Path("results/report")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    Path(paths.result("timing", "t-01")).write_text('{"truncated": ')
    Path("inputs.json").write_text(json.dumps(run))
    assert report.main(["--inputs", "inputs.json", "--outdir", "results/report"]) == 1
    err = capsys.readouterr().err
    assert paths.result("timing", "t-01") in err and "previous report" in err
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert [p.name for p in Path("results").iterdir() if p.name.startswith(".report")] == []


def test_failure_while_rendering_keeps_the_previous_one(run, monkeypatch):
    report.render(run, "results/report")
    before = Path("results/report/report.html").read_bytes()

    def broken(*args, **kwargs):
        raise RuntimeError("figure failed")

    monkeypatch.setattr(report.report_figures, "make_all", broken)
    with pytest.raises(RuntimeError):
        report.render(run, "results/report")
    assert Path("results/report/report.html").read_bytes() == before
    assert Path("results/report/figures/speedup.png").is_file()
    assert [p.name for p in Path("results").iterdir() if p.name.startswith(".report")] == []


def test_only_resource_skip_rows_still_render(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inputs = make_run(tmp_path, rows=[(_row("huge", 100_000_000, 1024, 1024), "skip")])
    context = report.render(inputs, "results/report")
    assert context["counts"]["resource-skip"] == 1
    html = Path("results/report/report.html").read_text()
    assert "huge" in html and "resource skip" in html and "No figures" in html


def test_provenance_verifies(run):
    from shapewise.provenance.provenance import verify

    report.render(run, "results/report")
    assert verify("results/report", artifacts_only=True, out=lambda *_: None) == 0


def test_baseline_section(run):
    report.render(run, "results/report")
    shutil.copytree("results/report", "baseline")
    # the baseline: t-01's optimized model much faster (so this run is a regression), t-02 routed differently,
    # a row this run does not have
    with open("baseline/summary.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    rows[0]["optimized_median_ms"] = "0.1"
    rows[0]["optimized_ci_low_ms"], rows[0]["optimized_ci_high_ms"] = "0.099", "0.101"
    rows[1]["route"] = "graph"
    gone = dict(rows[1], id="t-gone")
    with open("baseline/summary.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=report_data.SUMMARY_COLUMNS)
        writer.writeheader()
        writer.writerows(rows + [gone])
    context = report.render(dict(run, baseline="baseline"), "results/report")
    base = context["baseline"]
    assert base["regressions"] == ["t-01"]
    assert [r["id"] for r in base["removed"]] == ["t-gone"]
    assert [r["id"] for r in base["route_changes"]] == ["t-02"]
    html = Path("results/report/report.html").read_text()
    assert 'id="baseline"' in html and "t-gone" in html and f"graph → {LABEL}" in html


def test_bad_baseline_is_named(run):
    message = _refused(dict(run, baseline="nowhere"))
    assert "nowhere" in message and "baseline" in message


# ------------------------------------------------------------------ the DAG schedules a missing result again

REPO = Path(__file__).resolve().parent.parent


def _snakemake(cwd, *args):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "--config", "shapes=smoke", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_deleted_result_is_scheduled_again(tmp_path):
    """Rule all requests RESULT_TARGETS (workflow/rules/common.smk) besides the report: Snakemake does not rerun the
    job of a missing intermediate file whose consumer is up to date (it would say "Nothing to be done")."""
    from shapewise.inputs import manifest

    copy_checkout(tmp_path)
    rows = manifest.load_manifests([str(REPO / paths.manifest("smoke"))])
    files = list(paths.FINGERPRINTS.values()) + [paths.MICROBENCH]
    for row in rows:
        files += list(paths.per_shape(row["id"]).values()) + list(paths.profile_extra(row["id"]).values())
        files.append(paths.result(paths.WARMUP_STEP, row["id"]))  # a target of rule all too
    files += [f"results/report/{name}" for name in ("report.md", "report.html", "summary.csv", "provenance.json")]
    for name in files:
        write_json(tmp_path / name, {})
    _snakemake(tmp_path, "--touch")  # every output up to date, with Snakemake's metadata
    assert "Nothing to be done" in _snakemake(tmp_path, "-n")
    victim = paths.result("timing", rows[0]["id"])
    (tmp_path / victim).unlink()
    plan = _snakemake(tmp_path, "-n")
    assert "Nothing to be done" not in plan
    assert f"output: {victim}" in plan and "rule report:" in plan


def test_results_of_two_machines_are_grouped_apart(run):
    path = paths.result("timing", "t-02")
    data = json.loads(Path(path).read_text())
    data["environment"] = dict(data["environment"], gpu_name="Another GPU", machine_key="Another GPU | software 0")
    write_json(path, data)
    context = report.render(run, "results/report")
    assert [g["key"] for g in context["groups"]] == [MACHINE, "Another GPU | software 0"]
    assert [g["ids"] for g in context["groups"]] == [["t-01", "t-03"], ["t-02"]]
    assert context["groups"][1]["geomean_speedup"] == pytest.approx(1.4 / 0.6)
    md = Path("results/report/report.md").read_text()
    assert "These results come from 2 different machines" in md and "## Machine M2: Another GPU" in md
    with open("results/report/summary.csv", newline="") as fh:
        machines = {r["id"]: r["machine"] for r in csv.DictReader(fh)}
    assert machines == {"t-01": MACHINE, "t-02": "Another GPU | software 0", "t-03": MACHINE}
