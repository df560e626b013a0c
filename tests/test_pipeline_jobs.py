"""Single pipeline jobs on the CPU: the resource-skip path, the chunked check, the roofline model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shapewise.analysis import roofline
from shapewise.inputs.manifest import normalize_row, row_json

ROOT = Path(__file__).resolve().parent.parent
ROW = normalize_row({"id": "chunk-row", "batch_size": 3, "seq_len": 256, "d_model": 32, "num_heads": 2,
                     "ffn_dim": 64, "num_layers": 2, "trials": 1})


def job(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "workflow"), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "shapewise", "job", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def headroom_between_estimates(row):
    """A headroom whose budget lies between the optimized and the reference estimate."""
    import torch

    from shapewise.model import TransformerConfig
    from shapewise.model.memory import estimate_memory_bytes

    fields = ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers", "causal")
    cfg = TransformerConfig(**{k: row[k] for k in fields})
    ref = estimate_memory_bytes(cfg, torch.float32, "reference")
    opt = estimate_memory_bytes(cfg, torch.float32, "optimized")
    assert ref > 4 * opt
    with open("/proc/meminfo") as fh:
        available = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    return ((ref * opt) ** 0.5) / available  # geometric middle: robust to RAM moving a little


@pytest.mark.slow
def test_reference_that_does_not_fit_uses_the_chunked_check(tmp_path):
    row = row_json(ROW)
    job(tmp_path, "preflight", "--device", "cpu", "--row", row, "--headroom", str(headroom_between_estimates(ROW)),
        "--chunked", CHUNKED, "--out", "pre.json")
    pre = json.loads((tmp_path / "pre.json").read_text())
    assert pre["models"]["optimized"]["fits"] and not pre["models"]["reference"]["fits"]

    chunked = json.dumps({"batch_samples": 2, "query_block": 64, "query_samples": 2})
    job(tmp_path, "accuracy", "--device", "cpu", "--row", row, "--preflight", "pre.json", "--chunked", chunked,
        "--out", "acc.json")
    acc = json.loads((tmp_path / "acc.json").read_text())
    checked = acc["trials"][0]["checked"]
    assert acc["check_method"] == "chunked" and acc["status"] == "pass"
    assert checked["batch_indices"] == [0, 2]
    assert checked["query_ranges"] == [[0, 64], [192, 256]]
    assert checked["elements_compared"] == 2 * 128 * 32
    assert checked["elements_total"] == 3 * 256 * 32
    assert acc["aggregate"]["official"]["total_elements"] == 2 * 128 * 32


@pytest.mark.slow
def test_optimized_that_does_not_fit_is_a_resource_skip_not_a_pass(tmp_path):
    row = row_json(ROW)
    job(tmp_path, "preflight", "--device", "cpu", "--row", row, "--headroom", "1e-12", "--chunked", CHUNKED,
        "--out", "pre.json")
    job(tmp_path, "accuracy", "--device", "cpu", "--row", row, "--preflight", "pre.json", "--chunked",
        json.dumps({"batch_samples": 1, "query_block": 64, "query_samples": "all"}), "--out", "acc.json")
    acc = json.loads((tmp_path / "acc.json").read_text())
    assert acc["status"] == "resource-skip" and acc["trials"] == []


def test_roofline_counts():
    row = dict(batch_size=2, seq_len=8, d_model=16, num_heads=2, ffn_dim=32, num_layers=3, causal=False,
               dtype="float32")
    f = roofline.flops(**row)
    assert f["gemm"] == 2 * 16 * (4 * 16 * 16 + 2 * 16 * 32) * 3
    assert f["attention"] == 4 * 2 * 8 * 8 * 16 * 3
    assert roofline.flops(**dict(row, causal=True))["attention"] == f["attention"] // 2
    b = roofline.min_bytes(**row)
    assert b["activations"] == 2 * 2 * 8 * 16 * 4
    assert roofline.min_bytes(**dict(row, dtype="float16"))["total"] == b["total"] // 2
    floor = roofline.floor_seconds(row, peak_flops_per_s=1e12, bandwidth_bytes_per_s=1e9)
    assert floor["floor_s"] == max(f["total"] / 1e12, b["total"] / 1e9)
    assert floor["bound"] == "memory"


def test_roofline_parameter_count_matches_the_reference_model():
    from shapewise.model import BaselineTransformer, TransformerConfig

    cfg = TransformerConfig(batch_size=1, seq_len=4, d_model=24, num_heads=2, ffn_dim=40, num_layers=3)
    actual = sum(p.numel() for p in BaselineTransformer(cfg).parameters())
    assert roofline.parameter_count(24, 40, 3) == actual


def test_report_names_rows_that_ran_a_shorter_protocol():
    """A heavy row's shorter protocol is reported by row, never passed off as the common one."""
    from shapewise.report.report import protocols

    usual = {"warmup": 20, "rounds": 3, "calls": 100}
    short = {"warmup": 1, "rounds": 1, "calls": 3}
    rows = [{"id": f"r{i}", "data": {"timing": {"protocol": usual}, "ablation": {"protocol": usual}}}
            for i in range(3)]
    rows.append({"id": "heavy", "data": {"timing": {"protocol": short}, "ablation": {"protocol": usual}}})
    timing, ablation, exceptions = protocols(rows)
    assert timing == usual and ablation == usual
    assert exceptions == [{"id": "heavy", "step": "timing", "protocol": short}]


@pytest.mark.slow
def test_ablation_records_switches_the_route_does_not_use_and_configured_time_skips(tmp_path):
    """Forced triton route on the CPU (split layers: the policy's split_layer covers d_model 32 at any token count):
    fused_layer, cuda_graph and fused_layernorm are not applicable (not run, not a pass); a switch in the protocol's
    `skip` mapping is a time skip with its reason; the others run and are checked."""
    row = normalize_row({"id": "abl-row", "batch_size": 2, "seq_len": 7, "d_model": 32, "num_heads": 2,
                         "ffn_dim": 32, "num_layers": 1, "trials": 1, "route": "triton"})
    job(tmp_path, "preflight", "--device", "cpu", "--row", row_json(row), "--headroom", "0.85",
        "--chunked", CHUNKED, "--out", "pre.json")
    protocol = {"cpu": {"warmup": 0, "rounds": 1, "calls": 1, "skip": {"packed_qkv": "too slow here"}}}
    job(tmp_path, "ablation", "--device", "cpu", "--row", row_json(row), "--preflight", "pre.json",
        "--protocol", json.dumps(protocol), "--chunked", json.dumps({"batch_samples": 1, "query_block": 64,
                                                                      "query_samples": "all"}), "--out", "abl.json")
    abl = json.loads((tmp_path / "abl.json").read_text())
    by = {v["variant"]: v for v in abl["variants"]}
    assert abl["status"] == "ok" and by["all-on"]["route_detail"]["name"] == "triton"
    assert abl["switches_used"] == ["reduced_precision", "flash_attention", "packed_qkv", "split_layer"]
    for name in ("fused_layer", "cuda_graph", "fused_layernorm"):
        assert by[name]["skipped"] == "not-applicable" and "median_ms" not in by[name] and "passed" not in by[name]
    assert by["packed_qkv"] == {"variant": "packed_qkv", "disable": ["packed_qkv"], "skipped": "time",
                                "reason": "too slow here"}
    for name in ("reduced_precision", "flash_attention", "split_layer"):
        assert by[name]["passed"] and by[name]["median_ms"] > 0 and "skipped" not in by[name]
    assert by["reduced_precision"]["route_detail"]["precision"] == "fp32"


@pytest.mark.parametrize("ahead", [True, False], ids=["prepares", "alone"])
def test_a_preparing_ablation_builds_and_checks_every_variant_before_it_times_any(tmp_path, monkeypatch, ahead):
    """gpu_prepare_shared: the job builds and checks every variant (sharing its GPU), then holds the GPU alone and
    times them; otherwise it builds, checks and times one variant after another. The results are the same either
    way."""
    from types import SimpleNamespace

    from shapewise.jobs import ablation

    row = normalize_row({"id": "abl-row", "batch_size": 2, "seq_len": 7, "d_model": 32, "num_heads": 2,
                         "ffn_dim": 32, "num_layers": 1, "trials": 1, "route": "triton"})
    job(tmp_path, "preflight", "--device", "cpu", "--row", row_json(row), "--headroom", "0.85",
        "--chunked", CHUNKED, "--out", "pre.json")
    events = []
    build, time_calls = ablation.build_optimized, ablation.time_calls
    monkeypatch.setattr(ablation, "build_optimized", lambda *a, **k: events.append("build") or build(*a, **k))
    monkeypatch.setattr(ablation, "time_calls", lambda *a: events.append("time") or time_calls(*a))
    monkeypatch.setattr(ablation, "preparing", lambda device: ahead)
    monkeypatch.setattr(ablation, "hold_alone", lambda device: events.append("alone") or ahead)
    monkeypatch.setattr(ablation, "shared_then_alone", lambda device: ahead)
    args = SimpleNamespace(device="cpu", threads=1, row=row_json(row), preflight=str(tmp_path / "pre.json"),
                           protocol=json.dumps({"cpu": {"warmup": 1, "rounds": 1, "calls": 2}}), chunked=CHUNKED,
                           out=str(tmp_path / "abl.json"))
    assert ablation.main(args) == 0
    abl = json.loads((tmp_path / "abl.json").read_text())
    ran = [v for v in abl["variants"] if "median_ms" in v]
    n = len(ran)  # all on and the four switches the forced triton route uses
    assert n == 5 and all(v["passed"] and v["slowdown_vs_all_on"] > 0 for v in ran)
    assert events.count("build") == n and events.count("time") == n * 2  # warm-up and one round each
    if ahead:
        assert events == ["build"] * n + ["alone"] + ["time"] * 2 * n and abl["prepared_sharing"] is True
    else:
        assert events[:3] == ["build", "time", "time"] and "prepared_sharing" not in abl


@pytest.mark.parametrize("fits", [True, False], ids=["full", "chunked"])
def test_the_expected_output_is_computed_once_and_compares_as_the_check(monkeypatch, fits):
    """The ablation's variants run one input: `Expected` computes the reference once (full, or chunked on sampled
    batch elements and query blocks) and compares each output as `check` does, element counts included."""
    from shapewise.jobs import check as checks
    from shapewise.model import TransformerConfig

    from model_helpers import build_pair, make_inputs

    cfg = TransformerConfig(batch_size=3, seq_len=40, d_model=32, num_heads=2, ffn_dim=32, num_layers=1, causal=True)
    ref, _ = build_pair(cfg)
    x, mask = make_inputs(cfg, "holes")
    settings = {"batch_samples": 2, "query_block": 16, "query_samples": 2}
    calls = []
    for name in ("full_reference", "chunked_reference_forward"):
        real = getattr(checks, name)
        monkeypatch.setattr(checks, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    expected = checks.Expected(ref, x, mask, fits, settings)
    want = checks.full_reference(ref, x, mask)
    calls.clear()
    for out in (want + 1e-4, want.masked_fill(torch.rand_like(want) < 0.1, 1.0)):
        got, checked = expected.compare(out)
        assert (got, checked) == checks.check(ref, out, x, mask, fits, settings)
        assert checked["method"] == ("full" if fits else "chunked")
        assert checked["elements_compared"] == (out.numel() if fits else 2 * (16 + 8) * 32)  # first, last block
    assert len(calls) == 2  # the two `check` calls' references; `compare` computed none


@pytest.mark.parametrize("mask_kind", ["holes", "none"])
def test_a_chunked_check_keeps_only_its_samples(mask_kind):
    """The accuracy job's chunked check (Sampled) holds neither the whole input nor the whole output once the job
    lets go of them, and gives `check`'s answer; a full check keeps both and gives it too."""
    import weakref

    from shapewise.jobs import check as checks
    from shapewise.model import TransformerConfig

    from model_helpers import build_pair, make_inputs

    cfg = TransformerConfig(batch_size=4, seq_len=40, d_model=32, num_heads=2, ffn_dim=32, num_layers=1, causal=True)
    ref, _ = build_pair(cfg)
    settings = {"batch_samples": 2, "query_block": 16, "query_samples": "all"}
    for fits in (False, True):
        x, mask = make_inputs(cfg, mask_kind)
        out = checks.full_reference(ref, x, mask) + 1e-4
        want = checks.check(ref, out, x, mask, fits, settings)
        sampled = checks.Sampled(out, x, mask, fits, settings)
        gone = [weakref.ref(x), weakref.ref(out)]
        del x, out
        assert [r() is None for r in gone] == [not fits, not fits]
        got = sampled.check(ref)
        assert got == want
        assert got[1]["elements_compared"] == (4 if fits else 2) * 40 * 32 and got[1]["elements_total"] == 4 * 40 * 32


@pytest.mark.parametrize("shape", [(), (0, 3), (7,), (5, 3, 4), (129, 2)])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_all_finite_reads_blocks_and_finds_every_bad_element(shape, bad):
    """all_finite answers as torch.isfinite(t).all() does, wherever the one bad element sits (first, last, a
    middle block), with blocks smaller than a row, a row, and the whole tensor."""
    from shapewise.jobs.check import all_finite

    t = torch.randn(shape, dtype=torch.float64)
    places = [None] if bad is None or t.numel() == 0 else [0, t.numel() // 2, t.numel() - 1]
    for place in places:
        u = t.clone()
        if place is not None:
            u.view(-1)[place] = bad
        for block in (1, 3, max(1, u.numel())):
            assert all_finite(u, block_elements=block) == bool(torch.isfinite(u).all())


def test_roofline_peak_is_the_fastest_rate_the_row_may_use():
    """float32 rows may run fp16 operands (routing policy): their floor takes the fastest of TF32/fp16/bf16;
    fp16 rows take the fp16 rate, bf16 rows the faster of fp16 and bf16; a CPU float32 row the plain fp32 rate."""
    from shapewise.jobs.microbench import peaks

    gemm = {"fp32": {"tflop_per_s": 51.0}, "tf32": {"tflop_per_s": 402.0}, "fp16": {"tflop_per_s": 739.0},
            "bf16": {"tflop_per_s": 700.0}}
    cuda = {"device": "cuda", "gemm": gemm, "copy": {"gb_per_s": 4000.0}}
    assert peaks(cuda, "float32") == (739.0e12, 4000.0e9)
    assert peaks(cuda, "bfloat16")[0] == 739.0e12  # fp16 operands (routing policy) or bf16: the faster
    assert peaks({**cuda, "device": "cpu"}, "float32")[0] == 51.0e12
    assert peaks({**cuda, "gemm": {"tf32": {"tflop_per_s": 402.0}}}, "float32")[0] == 402.0e12
    assert peaks({**cuda, "gemm": {}}, "float16") == (None, 4000.0e9)


def test_only_huge_inputs_are_drawn_on_the_gpu(monkeypatch):
    """make_case draws inputs of at least DEVICE_DRAW_MIN_ELEMENTS on the GPU's generator (official row 14's CPU
    draw: about 20 s per case, estimated), everything else on the CPU generator: the same case on every device."""
    from shapewise.jobs import inputs as common
    from shapewise.model import TransformerConfig

    row14 = TransformerConfig(32, 100000, 1024, 16, 1024, 2, True)
    row6 = TransformerConfig(10000, 128, 128, 4, 128, 4, True)
    assert common.input_generator(row14, "cuda") == "device"
    assert common.input_generator(row14, "cpu") == "cpu"
    assert common.input_generator(row6, "cuda") == "cpu"
    monkeypatch.setattr(common, "DEVICE_DRAW_MIN_ELEMENTS", 10000 * 128 * 128)
    assert common.input_generator(row6, torch.device("cuda", 0)) == "device"


# --- resource skips, identity, the timing protocols, GPU identity and contention ---------------------------------

HUGE = normalize_row({"id": "huge-row", "batch_size": 100_000_000, "seq_len": 32, "d_model": 32, "num_heads": 2,
                      "ffn_dim": 64, "num_layers": 1, "trials": 1})
TIMING_SETTINGS = {"cpu": {"warmup": 0, "calls": 2, "min_rounds": 2, "max_rounds": 3, "ci_half_width": 0.5,
                           "gc_off": True, "cpus": "inherit"},
                   "cuda": "stable", "official": {"warmup": 20, "rounds": 3, "calls": 100},
                   "stable": {"warmup": 20, "calls": 50, "min_rounds": 6, "max_rounds": 30, "ci_half_width": 0.02,
                              "gc_off": True, "cpus": "per-slot"}}
CHUNKED = json.dumps({"batch_samples": 1, "query_block": 64, "query_samples": "all"})


def fake_preflight(path, reference_fits, optimized_fits):
    path.write_text(json.dumps({"budget_bytes": 1000, "models": {
        "reference": {"fits": reference_fits, "estimate_bytes": 10**14},
        "optimized": {"fits": optimized_fits, "estimate_bytes": 10**13}}}))


def fake_microbench(path):
    path.write_text(json.dumps({"device": "cpu", "environment": {"gpu_name": None, "cpu": "some cpu"},
                                "gemm": {"fp32": {"tflop_per_s": 1.0}}, "copy": {"gb_per_s": 10.0}}))


def test_a_row_that_does_not_fit_is_recorded_as_a_skip_by_every_job_without_allocating(tmp_path, monkeypatch):
    """Batch 100 000 000 (its input alone: 400 GB): accuracy, timing, profile and ablation write a resource skip
    with their identity, and none builds a model or draws the input."""
    from shapewise.cli import main
    from shapewise.jobs import ablation, accuracy, profile, timing
    from shapewise.provenance.identity import identity

    def refuse(*args, **kwargs):
        raise AssertionError("a skipped row must not build models or draw inputs")

    for module in (ablation, accuracy, profile, timing):
        for name in ("make_case", "build_models", "build_optimized"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse)
    monkeypatch.chdir(tmp_path)
    fake_preflight(tmp_path / "pre.json", reference_fits=False, optimized_fits=False)
    fake_microbench(tmp_path / "mb.json")
    row = row_json(HUGE)
    common = ["--device", "cpu", "--row", row, "--preflight", "pre.json", "--impl-digest", "impl-d",
              "--env-digest", "env-d"]
    assert main(["job", "timing", *common, "--microbench", "mb.json", "--protocol", json.dumps(TIMING_SETTINGS),
                 "--out", "timing.json"]) == 0
    assert main(["job", "accuracy", *common, "--chunked", CHUNKED, "--out", "accuracy.json"]) == 0
    assert main(["job", "profile", *common, "--capture", json.dumps({"cpu": {"warmup": 0, "calls": 1}}),
                 "--csv", "k.csv", "--trace", "trace.json", "--out", "profile.json"]) == 0
    assert main(["job", "ablation", *common, "--protocol", json.dumps({"cpu": {"warmup": 0, "rounds": 1, "calls": 1}}),
                 "--chunked", CHUNKED, "--out", "ablation.json"]) == 0
    expected = identity(HUGE, "impl-d", "env-d")
    for step in ("timing", "accuracy", "profile", "ablation"):
        result = json.loads((tmp_path / f"{step}.json").read_text())
        assert result["status"] == "resource-skip", step
        assert result["identity"] == expected, step
        assert result["call"] is None and result["gpu"] is None, step
    tim = json.loads((tmp_path / "timing.json").read_text())
    assert set(tim["skips"]) == {"reference", "optimized"} and "10000000000000 bytes" in tim["skips"]["optimized"]
    assert tim["speedup"] is None and tim["noisy"] is None and tim["protocol"]["name"] == "stable"
    assert "reference" not in tim and "optimized" not in tim
    acc = json.loads((tmp_path / "accuracy.json").read_text())
    assert acc["skip_reason"] == "resource skip: estimated 10000000000000 bytes > budget 1000 bytes"


def test_the_skip_reason_is_the_preflights_own_when_it_gives_one():
    from shapewise.jobs.io import resource_skip_reason

    pre = {"budget_bytes": 5, "models": {"optimized": {"fits": False, "estimate_bytes": 9, "budget_bytes": 7},
                                         "reference": {"fits": False, "estimate_bytes": 9, "reason": "too big"}}}
    assert resource_skip_reason(pre, "optimized") == "resource skip: estimated 9 bytes > budget 7 bytes"
    assert resource_skip_reason(pre, "reference") == "resource skip: too big"


def test_timing_job_records_protocol_intervals_call_and_identity(tmp_path):
    """A real (tiny) timing job on the CPU: the contract's fields are all there."""
    row = normalize_row({"id": "tiny-row", "batch_size": 2, "seq_len": 8, "d_model": 32, "num_heads": 2,
                         "ffn_dim": 32, "num_layers": 1, "trials": 1})
    fake_preflight(tmp_path / "pre.json", reference_fits=True, optimized_fits=True)
    pre = json.loads((tmp_path / "pre.json").read_text())
    pre["budget_bytes"] = 10**15
    (tmp_path / "pre.json").write_text(json.dumps(pre))
    fake_microbench(tmp_path / "mb.json")
    job(tmp_path, "timing", "--device", "cpu", "--row", row_json(row), "--preflight", "pre.json", "--microbench",
        "mb.json", "--protocol", json.dumps(TIMING_SETTINGS), "--impl-digest", "i", "--env-digest", "e",
        "--out", "t.json")
    tim = json.loads((tmp_path / "t.json").read_text())
    from shapewise.provenance.identity import identity

    assert tim["identity"] == identity(row, "i", "e") and tim["status"] == "ok"
    assert tim["protocol"]["name"] == "stable" and tim["protocol"]["gc_off"] is True
    assert 2 <= tim["stopping"]["rounds_run"] <= 3 and tim["stopping"]["reason"] in ("settled", "cap")
    for which in ("reference", "optimized"):
        entry = tim[which]
        assert len(entry["round_medians_ms"]) == tim["stopping"]["rounds_run"]
        low, high = entry["median_ci_ms"]
        assert low <= high and entry["rel_spread"] >= 0
        assert len(entry["times_ms"]) == 2 * tim["stopping"]["rounds_run"]
    assert set(tim["speedup_ci"]) == {"low", "high", "level", "method"} and isinstance(tim["noisy"], bool)
    assert tim["call"] == "model(x, mask)" if row["pass_mask"] else "model(x)"
    assert tim["gpu"] is None and tim["contention"]["checked"] is False
    assert tim["gpu_state"]["before"]["available"] is False and tim["started"] <= tim["finished"]
    # the official call's all-True mask: the optimized model without it, timed in the same rounds
    cost, unmasked = tim["mask_cost"], tim["optimized_unmasked"]
    assert cost["measured"] is True and cost["call"] == "model(x)" and cost["limit"] == 0.03
    assert len(unmasked["round_medians_ms"]) == tim["stopping"]["rounds_run"]
    ratios = [a / b for a, b in zip(tim["optimized"]["round_medians_ms"], unmasked["round_medians_ms"])]
    assert cost["round_ratios"] == pytest.approx(ratios) and cost["ratio"] == pytest.approx(np.median(ratios))
    assert cost["ratio_of_medians"] == pytest.approx(tim["optimized"]["median_ms"] / unmasked["median_ms"])
    assert 0 < cost["ratio_ci"]["low"] <= cost["ratio_ci"]["high"]
    assert cost["within_limit"] == (cost["ratio"] <= 1.03) and cost["route"] == cost["route_unmasked"]
    assert tim["route"] == cost["route"]


def test_mask_cost_is_measured_only_for_an_all_true_mask():
    from shapewise.analysis.stats import summarize
    from shapewise.jobs.timing import mask_cost

    rounds = {"optimized": [[1.1] * 4, [1.2] * 4, [1.1] * 4], "optimized_unmasked": [[1.0] * 4, [1.1] * 4, [1.0] * 4]}
    out = mask_cost(rounds, summarize(rounds), "all-true", {"optimized": "r", "optimized_unmasked": "r"})
    assert out["measured"] and out["ratio"] == pytest.approx(1.1) and out["within_limit"] is False
    assert out["ratio_ci"]["low"] <= 1.1 <= out["ratio_ci"]["high"]
    # rounds that switch between a quiet and a slow level (a host-bound spell), mostly on both sides at once: the
    # paired ratio keeps the quiet rounds' 5 % with a tight interval; the pooled medians' interval spans the spells
    quiet, slow = ([1.05, 1.06, 1.04, 1.05], [1.0, 1.01, 0.99, 1.0]), ([2.0] * 4, [2.0] * 4)
    spells = [quiet, quiet, quiet, slow, (slow[0], quiet[1]), quiet, (quiet[0], slow[1]), slow, quiet, quiet, quiet]
    rounds = {"optimized": [a for a, _ in spells], "optimized_unmasked": [b for _, b in spells]}
    out = mask_cost(rounds, summarize(rounds), "all-true", {})
    assert out["ratio"] == pytest.approx(1.05) and out["within_limit"] is False
    assert out["ratio_ci"]["low"] <= 1.05 <= out["ratio_ci"]["high"] and out["ratio_ci"]["high"] < 1.1
    pooled = out["ratio_of_medians_ci"]
    assert pooled["high"] - pooled["low"] > 2 * (out["ratio_ci"]["high"] - out["ratio_ci"]["low"])
    out = mask_cost({"optimized": [[1.0]] * 2, "optimized_unmasked": [[0.98]] * 2},
                    summarize({"optimized": [[1.0]] * 2, "optimized_unmasked": [[0.98]] * 2}), "all-true", {})
    assert out["within_limit"] is True
    for kind, words in (("none", "passes no mask"), ("prefix", "prefix, not all-True"),
                        ("general", "general, not all-True")):
        out = mask_cost({"optimized": [[1.0]] * 2}, {}, kind, {})
        assert out["measured"] is False and words in out["reason"], kind


def test_timing_protocol_names_resolve_and_heavy_rows_run_the_official_procedure():
    from shapewise.jobs.timing import resolve_protocol

    assert resolve_protocol(TIMING_SETTINGS, "cuda")[0] == "stable"
    assert resolve_protocol(dict(TIMING_SETTINGS, cuda="official"), "cuda") == \
        ("official", {"warmup": 20, "rounds": 3, "calls": 100})
    heavy = dict(TIMING_SETTINGS, cuda={"warmup": 1, "rounds": 1, "calls": 3})
    assert resolve_protocol(heavy, "cuda") == ("official", {"warmup": 1, "rounds": 1, "calls": 3})
    assert resolve_protocol(TIMING_SETTINGS, "cpu")[0] == "stable"
    with pytest.raises(SystemExit, match="'fast'"):
        resolve_protocol(dict(TIMING_SETTINGS, cuda="fast"), "cuda")
    with pytest.raises(SystemExit, match="min_rounds 5 > max_rounds 3"):
        resolve_protocol({"cpu": dict(TIMING_SETTINGS["cpu"], min_rounds=5)}, "cpu")


def scripted_time_calls(per_round, seen_gc):
    """A stand-in for device.time_calls: round r of each model returns per_round[model](r); records gc state."""
    import gc

    counters = {}

    def fake(fn, device, count):
        which = fn()
        r = counters.get(which, 0)
        counters[which] = r + 1
        seen_gc.append(gc.isenabled())
        return [per_round[which](r)] * count
    return fake


def test_stable_protocol_stops_when_the_interval_settles_and_at_its_cap(monkeypatch):
    import gc

    from shapewise.jobs import timing

    device = torch.device("cpu")
    calls = {"reference": lambda: "reference", "optimized": lambda: "optimized"}
    stable = {"warmup": 0, "calls": 4, "min_rounds": 3, "max_rounds": 12, "ci_half_width": 0.02, "gc_off": True,
              "cpus": "inherit"}
    seen_gc = []
    steady = {"reference": lambda r: 2.0 + 0.001 * (r % 2), "optimized": lambda r: 1.0}
    monkeypatch.setattr(timing, "time_calls", scripted_time_calls(steady, seen_gc))
    rounds, _, stopping = timing.run_rounds(calls, device, "stable", stable)
    assert stopping["reason"] == "settled" and stopping["rounds_run"] == 3 and len(rounds["reference"]) == 3
    assert seen_gc and not any(seen_gc) and gc.isenabled()  # collector off inside rounds, back on after

    seen_gc.clear()
    drifting = {"reference": lambda r: 2.0 * (1 + 0.5 * (r % 3)), "optimized": lambda r: 1.0}
    monkeypatch.setattr(timing, "time_calls", scripted_time_calls(drifting, seen_gc))
    rounds, _, stopping = timing.run_rounds(calls, device, "stable", stable)
    assert stopping["reason"] == "cap" and stopping["rounds_run"] == 12 and stopping["half_width"] > 0.02

    seen_gc.clear()
    monkeypatch.setattr(timing, "time_calls", scripted_time_calls(drifting, seen_gc))
    official = {"warmup": 0, "rounds": 3, "calls": 4}
    rounds, _, stopping = timing.run_rounds(calls, device, "official", official)
    assert stopping == {"rounds_run": 3, "reason": "fixed"} and all(seen_gc)  # the official protocol touches no gc


def clocked_time_calls(per_round, clock):
    """scripted_time_calls whose calls advance `clock` (a one-item list of seconds) by their own time: the rounds'
    elapsed time follows the models', as on a device."""
    counters = {}

    def fake(fn, device, count):
        which = fn()
        r = counters.get(which, 0)
        counters[which] = r + 1
        ms = per_round[which](r)
        clock[0] += ms * count * 1e-3
        return [ms] * count
    return fake


def test_stable_protocol_stops_before_a_round_that_would_pass_its_time_budget(monkeypatch):
    """max_seconds: a run that never settles (it would reach max_rounds) stops on time once another round, at the
    mean round so far, would pass the budget; never before min_rounds; null is no bound; settling still wins."""
    from shapewise.jobs import timing

    device = torch.device("cpu")
    calls = {"reference": lambda: "reference", "optimized": lambda: "optimized"}
    stable = {"warmup": 0, "calls": 4, "min_rounds": 3, "max_rounds": 12, "ci_half_width": 0.02, "gc_off": True,
              "cpus": "inherit"}
    # 4 calls of each model a round: rounds of 1.0, 0.8 and 1.2 s on the fake clock, a speedup that never settles
    drifting = {"reference": lambda r: (200.0, 150.0, 250.0)[r % 3], "optimized": lambda r: 50.0}

    def run(budget):
        clock = [0.0]
        monkeypatch.setattr(timing, "clock", lambda: clock[0])
        monkeypatch.setattr(timing, "time_calls", clocked_time_calls(drifting, clock))
        rounds, _, stopping = timing.run_rounds(calls, device, "stable", dict(stable, max_seconds=budget))
        return rounds, stopping, clock[0]

    # after 4 rounds 4.0 s, a fifth at the mean (1.0 s) fits 5.5 s; after 5 rounds 4.8 s, a sixth (0.96 s) does not
    rounds, stopping, elapsed = run(5.5)
    assert stopping["reason"] == "time" and stopping["rounds_run"] == 5 == len(rounds["optimized"])
    assert stopping["max_seconds"] == 5.5 and stopping["half_width"] > 0.02 and elapsed <= 5.5
    # a budget below one round still runs min_rounds
    _, stopping, _ = run(0.01)
    assert stopping["reason"] == "time" and stopping["rounds_run"] == 3 and stopping["max_seconds"] == 0.01
    # a budget that max_rounds fits within ends at the cap, as does none at all
    for budget in (12.5, None):
        _, stopping, _ = run(budget)
        assert stopping["reason"] == "cap" and stopping["rounds_run"] == 12 and stopping["max_seconds"] == budget
    _, stopping, _ = run(11.5)  # 10.8 s after 11 rounds: the twelfth, the cap's, would pass the budget
    assert (stopping["reason"], stopping["rounds_run"]) == ("time", 11)
    # an interval that settles within the budget stops on the interval
    steady = {"reference": lambda r: 200.0 + 0.1 * (r % 2), "optimized": lambda r: 50.0}
    clock = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: clock[0])
    monkeypatch.setattr(timing, "time_calls", clocked_time_calls(steady, clock))
    _, _, stopping = timing.run_rounds(calls, device, "stable", dict(stable, max_seconds=0.01))
    assert stopping["reason"] == "settled" and stopping["rounds_run"] == 3


@pytest.mark.parametrize("budget", [0, -1.5, "3", True, [3]])
def test_a_bad_time_budget_is_named(budget):
    """The job refuses what the schema refuses (tests/test_config.py), naming the field and the value."""
    from shapewise.jobs import timing

    stable = {"warmup": 0, "calls": 4, "min_rounds": 3, "max_rounds": 5, "ci_half_width": 0.02, "gc_off": True,
              "cpus": "inherit", "max_seconds": budget}
    with pytest.raises(SystemExit, match=r"max_seconds .*expected a number of seconds above 0, or null"):
        timing.run_rounds({"optimized": lambda: None}, torch.device("cpu"), "stable", stable)
    assert timing.max_seconds_of(dict(stable, max_seconds=None)) is None
    assert timing.max_seconds_of({}) is None
    assert timing.describe("stable", dict(stable, max_seconds=2.5), torch.device("cpu"))["max_seconds"] == 2.5


def test_round_seconds_cuts_a_slow_models_calls_a_round(monkeypatch):
    """round_seconds: a model's seconds per call, its warm-up's wall time over the warm-up's calls, sets its calls a
    round, max(min_calls, min(calls, floor(round_seconds / seconds per call))), for a model of another process
    (a Timed, as the candidate's Remote) as for one of this one; each entry records its count and its estimate, and
    the mask cost pairs rounds of different lengths by their medians. Without round_seconds, with no warm-up, and in
    the official protocol, every model gets `calls`."""
    from shapewise.analysis import stats
    from shapewise.jobs import timing

    clock = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: clock[0])
    # this process: the reference 20 ms a call, the unmasked call 80 ms
    monkeypatch.setattr(timing, "time_calls", clocked_time_calls(
        {"reference": lambda r: 20.0, "optimized_unmasked": lambda r: 80.0}, clock))

    class Elsewhere(timing.Timed):  # the optimized model, 1 ms a call, timed in its own process
        def __init__(self):
            self.asked = []

        def first_call(self):
            return 1.0

        def warmup(self, count):
            clock[0] += count * 1e-3
            return None

        def round(self, count, gc_off):
            self.asked.append(count)
            clock[0] += count * 1e-3
            return [1.0] * count, None

    def run(name, protocol):
        clock[0] = 0.0
        optimized = Elsewhere()
        calls = {"optimized": optimized, "reference": lambda: "reference",
                 "optimized_unmasked": lambda: "optimized_unmasked"}
        result = {"gpu": None}
        rounds, seen = timing.time_protocol(calls, {"id": "r"}, torch.device("cpu"), name, protocol, result)
        summary = stats.summarize(rounds)
        entries = timing.model_entries(rounds, summary, seen, 1, {"id": "r"})
        assert optimized.asked == [len(r) for r in rounds["optimized"]]
        assert all(entries[which]["calls_per_round"] == len(r) for which in rounds for r in rounds[which])
        return rounds, summary, entries, result["stopping"]

    stable = {"warmup": 4, "calls": 10, "min_rounds": 2, "max_rounds": 3, "ci_half_width": 0.5, "gc_off": False,
              "cpus": "inherit", "round_seconds": 0.1, "min_calls": 2}
    rounds, summary, entries, stopping = run("stable", stable)
    # 0.1 s over 20 ms: 5 calls; over 1 ms: 100, at most calls (10); over 80 ms: 1, at least min_calls (2)
    assert {which: entry["calls_per_round"] for which, entry in entries.items()} == \
        {"reference": 5, "optimized": 10, "optimized_unmasked": 2}
    assert {which: entry["seconds_per_call_estimate"] for which, entry in entries.items()} == \
        {"reference": pytest.approx(0.02), "optimized": pytest.approx(0.001), "optimized_unmasked": pytest.approx(0.08)}
    assert stopping["reason"] == "settled" and stopping["rounds_run"] == 2
    assert summary["speedup"] == pytest.approx(20.0) and stats.settled_width(rounds) == pytest.approx(0.0)
    cost = timing.mask_cost(rounds, summary, "all-true", {})
    assert cost["ratio"] == pytest.approx(1 / 80) and cost["round_ratios"] == [pytest.approx(1 / 80)] * 2

    # min_calls absent: min(MIN_ROUND_CALLS, calls)
    no_floor = {k: v for k, v in stable.items() if k != "min_calls"}
    _, _, entries, _ = run("stable", dict(no_floor, calls=20))
    assert {which: entry["calls_per_round"] for which, entry in entries.items()} == \
        {"reference": timing.MIN_ROUND_CALLS, "optimized": 20, "optimized_unmasked": timing.MIN_ROUND_CALLS}

    unbounded = {k: v for k, v in stable.items() if k not in ("round_seconds", "min_calls")}
    official = {"warmup": 4, "rounds": 2, "calls": 10, "round_seconds": 0.1}  # the official protocol never reads it
    for name, protocol in (("stable", unbounded), ("stable", dict(unbounded, round_seconds=None)),
                           ("stable", dict(stable, warmup=0)), ("official", official)):
        rounds, _, entries, _ = run(name, protocol)
        assert all(len(r) == 10 for model_rounds in rounds.values() for r in model_rounds), (name, protocol)
        assert {entry["calls_per_round"] for entry in entries.values()} == {10}
        estimates = {which: entry["seconds_per_call_estimate"] for which, entry in entries.items()}
        assert estimates == (dict.fromkeys(entries) if protocol["warmup"] == 0 else
                             {"reference": pytest.approx(0.02), "optimized": pytest.approx(0.001),
                              "optimized_unmasked": pytest.approx(0.08)})


def test_run_rounds_takes_each_models_calls_a_round():
    """calls_per_round: a model it names gets its count every round, one it does not name (or no dict) `calls`."""
    from shapewise.jobs import timing

    stable = {"warmup": 0, "calls": 4, "min_rounds": 2, "max_rounds": 2, "ci_half_width": 0.5, "gc_off": False,
              "cpus": "inherit"}
    calls = {"reference": lambda: None, "optimized": lambda: None}
    rounds, _, _ = timing.run_rounds(calls, torch.device("cpu"), "stable", stable, calls_per_round={"reference": 2})
    assert [len(r) for r in rounds["reference"]] == [2, 2] and [len(r) for r in rounds["optimized"]] == [4, 4]
    rounds, _, _ = timing.run_rounds(calls, torch.device("cpu"), "stable", stable)
    assert {len(r) for model_rounds in rounds.values() for r in model_rounds} == {4}


@pytest.mark.parametrize("field,value", [("round_seconds", 0), ("round_seconds", -0.5), ("round_seconds", "0.5"),
                                         ("round_seconds", True), ("round_seconds", [1]), ("min_calls", 0),
                                         ("min_calls", -1), ("min_calls", 2.5), ("min_calls", True),
                                         ("min_calls", "2"), ("min_calls", 5)])
def test_a_bad_round_bound_is_named(field, value):
    """The job refuses what the schema refuses (tests/test_config.py), and a min_calls above calls, which the
    schema cannot compare, naming the field and the value; a min_calls is checked without round_seconds too."""
    import re

    from shapewise.jobs import timing

    stable = {"warmup": 0, "calls": 4, "min_rounds": 3, "max_rounds": 5, "ci_half_width": 0.02, "gc_off": True,
              "cpus": "inherit", "round_seconds": 0.5, field: value}
    words = rf"{field} {re.escape(repr(value))}: expected "
    with pytest.raises(SystemExit, match=words):
        timing.run_rounds({"optimized": lambda: None}, torch.device("cpu"), "stable", stable)
    with pytest.raises(SystemExit, match=words):
        timing.describe("stable", stable, torch.device("cpu"))
    if field == "min_calls":
        with pytest.raises(SystemExit, match=words):
            timing.round_seconds_of({k: v for k, v in stable.items() if k != "round_seconds"})


def test_the_round_bound_is_recorded_with_the_protocol():
    """describe: round_seconds and the min_calls it uses (absent: min(MIN_ROUND_CALLS, calls)); both None without
    a bound; the official protocol has neither."""
    from shapewise.jobs import timing

    cpu = torch.device("cpu")
    stable = {"warmup": 0, "calls": 50, "min_rounds": 3, "max_rounds": 5, "ci_half_width": 0.02, "gc_off": True,
              "cpus": "inherit"}
    recorded = timing.describe("stable", dict(stable, round_seconds=0.5), cpu)
    assert (recorded["round_seconds"], recorded["min_calls"]) == (0.5, timing.MIN_ROUND_CALLS)
    recorded = timing.describe("stable", dict(stable, round_seconds=0.5, calls=4), cpu)
    assert recorded["min_calls"] == 4
    recorded = timing.describe("stable", dict(stable, round_seconds=1, min_calls=3.0), cpu)
    assert (recorded["round_seconds"], recorded["min_calls"]) == (1, 3) and type(recorded["min_calls"]) is int
    for unbounded in (stable, dict(stable, round_seconds=None), dict(stable, min_calls=3)):
        recorded = timing.describe("stable", unbounded, cpu)
        assert (recorded["round_seconds"], recorded["min_calls"]) == (None, None)
    assert "round_seconds" not in timing.describe("official", {"warmup": 20, "rounds": 3, "calls": 100}, cpu)


FAKE_UUID = "GPU-58f2a1b0-0000-1111-2222-333344445555"
OTHER_UUID = "GPU-99999999-0000-1111-2222-333344445555"


def fake_gpu():
    return {"index": 0, "uuid": FAKE_UUID, "name": "NVIDIA H200", "slot": "1", "slot_source": "lock",
            "cuda_visible_devices": "1"}


def test_gpu_identity_names_index_uuid_model_and_slot(monkeypatch):
    from types import SimpleNamespace

    from shapewise.jobs import device as dev

    props = SimpleNamespace(uuid="58f2a1b0-0000-1111-2222-333344445555", name="NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setenv("SHAPEWISE_PIPELINE_GPU_SLOT", "1")
    monkeypatch.setenv("SHAPEWISE_PIPELINE_GPU_SLOT_SOURCE", "lock")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert dev.gpu_identity("cuda") == fake_gpu()
    assert dev.gpu_identity("cpu") is None


def test_gpu_state_parses_clocks_and_marks_missing_readings(monkeypatch):
    from shapewise.jobs import device as dev

    asked = []
    monkeypatch.setattr(dev, "nvidia_smi", lambda args: asked.append(args) or "1980, 2619, 41, 122.35\n")
    state = dev.gpu_state(fake_gpu())
    assert state["available"] and state["sm_clock_mhz"] == 1980 and state["mem_clock_mhz"] == 2619
    assert state["temperature_c"] == 41 and state["power_w"] == 122.35
    assert f"--id={FAKE_UUID}" in asked[0]
    monkeypatch.setattr(dev, "nvidia_smi", lambda args: "1980, 2619, 41, [N/A]\n")
    assert dev.gpu_state(fake_gpu())["power_w"] is None
    monkeypatch.setattr(dev, "nvidia_smi", lambda args: None)
    assert dev.gpu_state(fake_gpu())["available"] is False
    assert dev.gpu_state(None) == {"available": False, "reason": "CPU job: no GPU"}


def test_contention_lists_other_processes_on_this_gpu_only(monkeypatch):
    from shapewise.jobs import device as dev

    me = os.getpid()
    listing = (f"{FAKE_UUID}, {me}, python, 1200\n"
               f"{FAKE_UUID}, 4242, other_trainer, 30000\n"
               f"{OTHER_UUID}, 777, elsewhere, 500\n")
    monkeypatch.setattr(dev, "nvidia_smi", lambda args: listing)
    busy = dev.compute_processes(fake_gpu())
    assert [p["pid"] for p in busy] == [me, 4242] and busy[1]["used_memory_bytes"] == 30000 * 2**20
    alone = [p for p in busy if p["pid"] == me]
    out = dev.contention(fake_gpu(), [{"at": "before", "processes": alone}, {"at": "after", "processes": busy}])
    assert out["checked"] and out["contended"] and out["own_pid_listed"]
    assert out["other_processes"] == [{"pid": 4242, "name": "other_trainer", "used_memory_bytes": 30000 * 2**20,
                                       "seen": ["after"]}]
    quiet = dev.contention(fake_gpu(), [{"at": "before", "processes": alone}, {"at": "after", "processes": alone}])
    assert quiet["checked"] and not quiet["contended"] and quiet["other_processes"] == []
    # another pid namespace (a container): our pid never shows; one listed process is taken to be us
    foreign_me = [{"pid": 1, "name": "python", "used_memory_bytes": 1}]
    ns = dev.contention(fake_gpu(), [{"at": "before", "processes": foreign_me}])
    assert not ns["contended"] and "namespace" in ns["note"]
    monkeypatch.setattr(dev, "nvidia_smi", lambda args: None)
    none = dev.contention(fake_gpu(), [{"at": "before", "processes": dev.compute_processes(fake_gpu()),
                                        "memory_used_bytes": dev.gpu_memory_used_bytes(fake_gpu())}])
    assert none["checked"] is False and none["contended"] is False


def test_contention_by_memory_when_no_process_is_listed_not_even_ours(monkeypatch):
    """In a container nvidia-smi lists no process (H200 machine, 2026-11-30): the GPU's used memory beyond this
    job's own reservation decides."""
    from shapewise.jobs import device as dev

    monkeypatch.setattr(dev, "nvidia_smi", lambda args: "30000\n")  # memory.used, MiB
    assert dev.gpu_memory_used_bytes(fake_gpu()) == 30000 * 2**20
    gib = 2**30
    busy = dev.contention(fake_gpu(), [{"at": "before", "processes": [], "memory_used_bytes": 2 * gib,
                                        "own_reserved_bytes": gib},
                                       {"at": "after", "processes": [], "memory_used_bytes": 30 * gib,
                                        "own_reserved_bytes": gib}])
    assert busy["checked"] and busy["method"] == "memory" and busy["contended"]
    assert busy["memory_beyond_own_bytes"] == {"before": gib, "after": 29 * gib}
    quiet = dev.contention(fake_gpu(), [{"at": "before", "processes": [], "memory_used_bytes": 2 * gib,
                                         "own_reserved_bytes": gib}])
    assert quiet["checked"] and not quiet["contended"] and "pid namespace" in quiet["note"]


def test_a_preparing_timing_job_makes_its_first_calls_before_it_holds_the_gpu_alone(monkeypatch):
    """gpu_prepare_shared: the optimized and reference models' first calls come first (sharing the GPU), then the
    job holds its GPU alone and reads the GPU's state, then the warm-ups, the unmasked call's first call after the
    official call's warm-up (whose peak memory would hold its graph), and the rounds. Each model's peak memory is
    its own first call's and warm-up's."""
    from shapewise.jobs import timing

    events = []

    class Model(timing.Timed):
        def __init__(self, which, peak):
            self.which, self.peak = which, peak

        def first_call(self):
            events.append(f"first {self.which}")
            return 1.0

        def warmup(self, count):
            events.append(f"warm {self.which}")
            return self.peak

        def round(self, count, gc_off):
            return [1.0] * count, self.peak

    monkeypatch.setattr(timing, "hold_alone", lambda device: events.append("alone") or True)
    monkeypatch.setattr(timing, "shared_then_alone", lambda device: True)
    waited = iter([0.0, 0.0, 0.0, 2.5])  # the reference's first call waited 2.5 s for the GPU alone (a kernel choice)
    monkeypatch.setattr(timing, "alone_waited_s", lambda: next(waited, 2.5))
    monkeypatch.setattr(timing, "gpu_state", lambda gpu: events.append("state") or {})
    calls = {"optimized": Model("optimized", 1), "reference": Model("reference", 2),
             "optimized_unmasked": Model("optimized_unmasked", 3)}
    result = {"gpu": None}
    protocol = {"warmup": 2, "calls": 3, "min_rounds": 2, "max_rounds": 2, "ci_half_width": 0.5, "gc_off": False,
                "cpus": "inherit"}
    _, seen = timing.time_protocol(calls, {"id": "r"}, torch.device("cpu"), "stable", protocol, result,
                                   prepared=["optimized", "reference"])
    assert events == ["first optimized", "first reference", "alone", "state", "warm optimized", "warm reference",
                      "first optimized_unmasked", "warm optimized_unmasked", "state"]
    assert result["first_calls_shared"] == ["optimized", "reference"] and seen["warm_peak"]["optimized"] == 1
    assert seen["first"] == {"optimized": 1.0, "reference": 1.0 - 2500.0, "optimized_unmasked": 1.0}


def test_a_run_job_waiting_to_hold_the_gpu_alone_is_idle_not_contention(monkeypatch):
    """A job of the run waiting to hold the GPU alone (its waiting note) runs nothing there: its process is listed
    as idle, and its memory counted as the run's, whether the check goes by pid or by memory; any other process
    still makes the job contended."""
    from shapewise.jobs import device as dev

    me, gib = os.getpid(), 2**30
    waiting = [{"pid": 5151, "job": "ablation results/ablation/x.json", "reserved_bytes": 3 * gib}]
    ours = {"pid": me, "name": "python", "used_memory_bytes": gib}
    idle = {"pid": 5151, "name": "python", "used_memory_bytes": 4 * gib}
    by_pid = dev.contention(fake_gpu(), [{"at": "before", "processes": [ours, idle], "run_waiting": waiting},
                                         {"at": "after", "processes": [ours], "run_waiting": []}])
    assert by_pid["method"] == "pid" and not by_pid["contended"] and by_pid["other_processes"] == []
    assert [(j["pid"], j["seen"]) for j in by_pid["idle_run_jobs"]] == [(5151, ["before"])]
    other = {"pid": 4242, "name": "trainer", "used_memory_bytes": gib}
    assert dev.contention(fake_gpu(), [{"at": "before", "processes": [ours, idle, other],
                                        "run_waiting": waiting}])["contended"]
    by_memory = dev.contention(fake_gpu(), [{"at": "before", "processes": [], "memory_used_bytes": 9 * gib,
                                             "own_reserved_bytes": 2 * gib, "run_waiting": waiting}])
    assert by_memory["method"] == "memory" and not by_memory["contended"]
    assert by_memory["memory_beyond_own_bytes"] == {"before": 9 * gib - 2 * gib - 3 * gib - dev.IDLE_CONTEXT_BYTES}
    assert dev.contention(fake_gpu(), [{"at": "before", "processes": [], "memory_used_bytes": 9 * gib,
                                        "own_reserved_bytes": 2 * gib}])["contended"]
    # another pid namespace: neither our pid nor the waiting job's is listed; two listed processes are the two
    unlisted = [{"pid": 1, "name": "python", "used_memory_bytes": gib}, {"pid": 2, "name": "python",
                                                                         "used_memory_bytes": 4 * gib}]
    ns = dev.contention(fake_gpu(), [{"at": "before", "processes": unlisted, "run_waiting": waiting}])
    assert not ns["contended"] and not ns["own_pid_listed"]
    third = [*unlisted, {"pid": 3, "name": "trainer", "used_memory_bytes": gib}]
    assert dev.contention(fake_gpu(), [{"at": "before", "processes": third, "run_waiting": waiting}])["contended"]


def test_cpu_pinning_per_slot_inherit_and_explicit(monkeypatch, tmp_path):
    from shapewise.execution import cpus
    from shapewise.jobs import device as dev

    # no topology (each logical CPU its own core), whatever this machine's siblings: tests/test_cpus.py has those
    monkeypatch.setattr(cpus, "SYSFS_ROOT", str(tmp_path / "no-sysfs"))
    monkeypatch.setattr(cpus, "_JOB_START", None)
    original, threads = os.sched_getaffinity(0), torch.get_num_threads()
    allowed = sorted(original)
    try:
        assert dev.pin_cpus("inherit")["applied"] is False
        monkeypatch.setenv("SHAPEWISE_PIPELINE_GPU_SLOT_SOURCE", "slurm")
        assert dev.pin_cpus("per-slot")["applied"] is False
        monkeypatch.setenv("SHAPEWISE_PIPELINE_GPU_SLOT_SOURCE", "lock")
        monkeypatch.setenv("SHAPEWISE_PIPELINE_GPUS", "0,3")
        monkeypatch.setenv("SHAPEWISE_PIPELINE_GPU_SLOT", "3")
        done = dev.pin_cpus("per-slot")
        if len(allowed) >= 2:
            assert done["applied"] and done["cores"] == allowed[len(allowed) // 2:]
            assert sorted(os.sched_getaffinity(0)) == done["cores"]
        monkeypatch.setenv("SHAPEWISE_PIPELINE_GPU_SLOT", "5")
        with pytest.raises(SystemExit, match="SHAPEWISE_PIPELINE_GPU_SLOT='5' is not in the pool"):
            dev.pin_cpus("per-slot")
        os.sched_setaffinity(0, original)
        with pytest.raises(SystemExit, match=r"cores \[100000\] are not among"):
            dev.pin_cpus([allowed[0], 100000])
        assert dev.pin_cpus([allowed[0]])["cores"] == [allowed[0]]
    finally:
        os.sched_setaffinity(0, original)
        torch.set_num_threads(threads)


def test_microbench_uses_do_bench_median_on_a_gpu(monkeypatch):
    import triton.testing

    from shapewise.jobs import microbench

    seen = {}

    def fake_do_bench(fn, warmup, rep, return_mode):
        seen.update(warmup=warmup, rep=rep, return_mode=return_mode)
        return 0.25
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    assert microbench._median_ms(lambda: None, torch.device("cuda"), repeats=3) == 0.25
    assert seen == {"warmup": microbench.DO_BENCH_WARMUP_MS, "rep": microbench.DO_BENCH_REP_MS,
                    "return_mode": "median"}
    assert microbench._median_ms(lambda: None, torch.device("cpu"), repeats=3) >= 0


def test_a_damaged_earlier_result_is_named(tmp_path):
    """A truncated preflight (or microbench) file stops the job with the file's name and the command that redoes
    it, not a bare JSONDecodeError."""
    from shapewise.jobs.io import read_json

    bad = tmp_path / "results" / "preflight" / "row-a.json"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"models": {"optimized": {"fits": tr')
    with pytest.raises(SystemExit) as info:
        read_json(bad)
    message = str(info.value)
    assert str(bad) in message and "not valid JSON" in message
    assert "--forcerun $(shapewise targets row-a)" in message


def test_triton_cache_entries_count_compiled_kernels(tmp_path, monkeypatch):
    """The timing job tells a first call that compiled from one that loaded: new kernel directories in Triton's
    cache between before and after; None under the interpreter (nothing is compiled there)."""
    from shapewise.jobs.device import triton_cache_entries

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert triton_cache_entries() == 0
    (tmp_path / "a1b2").mkdir()
    (tmp_path / "c3d4").mkdir()
    (tmp_path / "stray.lock").write_text("")
    assert triton_cache_entries() == 2
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_cache_entries() is None


def test_core_pick_pins_the_launching_thread_to_the_cheapest_core_before_every_round(monkeypatch):
    from shapewise.jobs import device as jobs_device
    from shapewise.jobs import timing

    cores = sorted(os.sched_getaffinity(0))
    cheap = cores[-1]
    probed = []

    def cost_of(core):  # the cost of the core the thread is on now, as the real probe measures it
        on = sorted(os.sched_getaffinity(0))
        probed.append((core, on))
        return 5.0 if core == cheap else 9.0

    try:
        picked = jobs_device.pick_core(cores, cost_of)
        assert picked == {"core": cheap, "launch_us": 5.0, "median_launch_us": 9.0 if len(cores) > 2 else 7.0,
                          "cores_probed": len(cores)}
        assert sorted(os.sched_getaffinity(0)) == [cheap]
        assert all(on == [core] for core, on in probed) and len(probed) == 2 * len(cores)
    finally:
        os.sched_setaffinity(0, cores)

    # run_rounds picks before every round, records each pick, and gives the thread its cores back
    picks = []
    monkeypatch.setattr(timing, "launch_cost_us", lambda device: 5.0 if os.sched_getaffinity(0) == {cheap} else 9.0)
    monkeypatch.setattr(timing, "pick_core", lambda cs, cost: picks.append(jobs_device.pick_core(cs, cost)) or picks[-1])
    monkeypatch.setattr(timing, "time_calls", scripted_time_calls({"reference": lambda r: 2.0, "optimized": lambda r: 1.0}, []))
    stable = {"warmup": 0, "calls": 4, "min_rounds": 3, "max_rounds": 5, "ci_half_width": 0.02, "gc_off": True,
              "cpus": "inherit", "core_pick": "fastest-launch"}
    fake_cuda = type("FakeDevice", (), {"type": "cuda"})()
    monkeypatch.setattr(timing, "peak_memory_reset", lambda device: None)
    monkeypatch.setattr(timing, "peak_memory_bytes", lambda device: None)
    calls = {"reference": lambda: "reference", "optimized": lambda: "optimized"}
    _, _, stopping = timing.run_rounds(calls, fake_cuda, "stable", stable)
    assert len(picks) == stopping["rounds_run"] == 3 and {p["core"] for p in picks} == {cheap}
    assert stopping["core_pick"]["rounds"] == picks and stopping["core_pick"]["method"] == "fastest-launch"
    assert sorted(os.sched_getaffinity(0)) == cores


def test_core_pick_is_checked_and_needs_a_gpu():
    import yaml

    from shapewise.inputs import paths
    from shapewise.jobs import device as jobs_device
    from shapewise.jobs import timing

    stable = {"warmup": 0, "calls": 4, "min_rounds": 3, "max_rounds": 5, "ci_half_width": 0.02, "gc_off": True,
              "cpus": "inherit"}
    assert timing.core_pick_of(stable) == "none"  # absent = none
    assert timing.describe("stable", dict(stable, core_pick="fastest-launch"),
                           torch.device("cpu"))["core_pick"] == "fastest-launch"
    with pytest.raises(SystemExit, match="core_pick 'fastest'.*expected one of"):
        timing.core_pick_of(dict(stable, core_pick="fastest"))
    calls = {"reference": lambda: "reference", "optimized": lambda: "optimized"}
    with pytest.raises(SystemExit, match="needs a CUDA device, this job runs on cpu"):
        timing.run_rounds(calls, torch.device("cpu"), "stable", dict(stable, core_pick="fastest-launch"))
    schema = yaml.safe_load(Path(paths.CONFIG_SCHEMA).read_text())
    assert tuple(schema["definitions"]["stable_protocol"]["properties"]["core_pick"]["enum"]) == jobs_device.CORE_PICKS


@pytest.mark.parametrize("gc_off", [True, False])
def test_stable_rounds_run_with_the_collector_off_and_the_jobs_objects_frozen(gc_off):
    """gc_off: each round runs with the collector disabled and what the job held before the first round frozen (a
    collection walks only what came since); afterwards the collector is on and nothing stays frozen."""
    import gc

    from shapewise.jobs import timing

    seen = []

    def call():
        seen.append((gc.isenabled(), gc.get_freeze_count() > 0))

    stable = {"warmup": 0, "calls": 2, "min_rounds": 2, "max_rounds": 3, "ci_half_width": 0.5, "gc_off": gc_off,
              "cpus": "inherit"}
    timing.run_rounds({"optimized": call}, torch.device("cpu"), "stable", stable)
    assert seen and set(seen) == ({(False, True)} if gc_off else {(True, False)})
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_the_accuracy_aggregate_counts_non_finite_elements_and_its_sentence_names_them():
    """An output of NaN: the trials' sum keeps the non-finite count, so a failure reads 'non-finite', never 'max abs
    error 0' alone."""
    from shapewise.jobs.accuracy import aggregate
    from shapewise.model import compare_outputs, describe_comparison

    ref = torch.zeros(6)
    trials = [{"comparisons": {"official": compare_outputs(ref, out, rtol=0.02, atol=0.002).as_dict()}}
              for out in (torch.full((6,), float("nan")), torch.zeros(6))]
    official = aggregate(trials)["official"]
    assert official["nonfinite_elements"] == 6 and official["failed_elements"] == 6 and not official["passed"]
    sentence = describe_comparison(official, "the official tolerance")
    assert sentence.startswith("6 of 12 elements outside the official tolerance, 6 of them non-finite"), sentence
