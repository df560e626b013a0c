"""Single pipeline jobs on the CPU: the resource-skip path, the chunked check, the roofline model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shapewise import roofline
from shapewise.manifest import normalize_row, row_json

ROOT = Path(__file__).resolve().parent.parent
ROW = normalize_row({"id": "chunk-row", "batch_size": 3, "seq_len": 256, "d_model": 32, "num_heads": 2,
                     "ffn_dim": 64, "num_layers": 2, "trials": 1})


def job(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
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
        "--out", "pre.json")
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
    job(tmp_path, "preflight", "--device", "cpu", "--row", row, "--headroom", "1e-12", "--out", "pre.json")
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
    from shapewise.report import protocols

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
    """Forced triton route on the CPU: fused_layer and cuda_graph are not applicable (not run, not a pass);
    a switch in the protocol's `skip` mapping is a time skip with its reason; the others run and are checked."""
    row = normalize_row({"id": "abl-row", "batch_size": 2, "seq_len": 7, "d_model": 32, "num_heads": 2,
                         "ffn_dim": 32, "num_layers": 1, "trials": 1, "route": "triton"})
    job(tmp_path, "preflight", "--device", "cpu", "--row", row_json(row), "--headroom", "0.85", "--out", "pre.json")
    protocol = {"cpu": {"warmup": 0, "rounds": 1, "calls": 1, "skip": {"packed_qkv": "too slow here"}}}
    job(tmp_path, "ablation", "--device", "cpu", "--row", row_json(row), "--preflight", "pre.json",
        "--protocol", json.dumps(protocol), "--chunked", json.dumps({"batch_samples": 1, "query_block": 64,
                                                                      "query_samples": "all"}), "--out", "abl.json")
    abl = json.loads((tmp_path / "abl.json").read_text())
    by = {v["variant"]: v for v in abl["variants"]}
    assert abl["status"] == "ok" and by["all-on"]["route_detail"]["name"] == "triton"
    assert abl["switches_used"] == ["reduced_precision", "flash_attention", "fused_layernorm", "packed_qkv"]
    for name in ("fused_layer", "cuda_graph"):
        assert by[name]["skipped"] == "not-applicable" and "median_ms" not in by[name] and "passed" not in by[name]
    assert by["packed_qkv"] == {"variant": "packed_qkv", "disable": ["packed_qkv"], "skipped": "time",
                                "reason": "too slow here"}
    for name in ("reduced_precision", "flash_attention", "fused_layernorm"):
        assert by[name]["passed"] and by[name]["median_ms"] > 0 and "skipped" not in by[name]
    assert by["reduced_precision"]["route_detail"]["precision"] == "fp32"


def test_roofline_peak_is_the_fastest_rate_the_row_may_use():
    """float32 rows may run fp16 operands (routing policy): their floor takes the fastest of TF32/fp16/bf16;
    fp16 rows take the fp16 rate; a CPU float32 row the plain fp32 rate."""
    from shapewise.jobs.microbench import peaks

    gemm = {"fp32": {"tflop_per_s": 51.0}, "tf32": {"tflop_per_s": 402.0}, "fp16": {"tflop_per_s": 739.0},
            "bf16": {"tflop_per_s": 700.0}}
    cuda = {"device": "cuda", "gemm": gemm, "copy": {"gb_per_s": 4000.0}}
    assert peaks(cuda, "float32") == (739.0e12, 4000.0e9)
    assert peaks(cuda, "bfloat16")[0] == 700.0e12
    assert peaks({**cuda, "device": "cpu"}, "float32")[0] == 51.0e12
    assert peaks({**cuda, "gemm": {"tf32": {"tflop_per_s": 402.0}}}, "float32")[0] == 402.0e12
    assert peaks({**cuda, "gemm": {}}, "float16") == (None, 4000.0e9)


def test_only_huge_inputs_are_drawn_on_the_gpu(monkeypatch):
    """make_case draws inputs of at least DEVICE_DRAW_MIN_ELEMENTS on the GPU's generator (official row 14's CPU
    draw: about 20 s per case, estimated), everything else on the CPU generator: the same case on every device."""
    from shapewise.model import TransformerConfig
    from shapewise.jobs import inputs as common

    row14 = TransformerConfig(32, 100000, 1024, 16, 1024, 2, True)
    row6 = TransformerConfig(10000, 128, 128, 4, 128, 4, True)
    assert common.input_generator(row14, "cuda") == "device"
    assert common.input_generator(row14, "cpu") == "cpu"
    assert common.input_generator(row6, "cuda") == "cpu"
    monkeypatch.setattr(common, "DEVICE_DRAW_MIN_ELEMENTS", 10000 * 128 * 128)
    assert common.input_generator(row6, torch.device("cuda", 0)) == "device"
