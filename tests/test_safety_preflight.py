"""The preflight of a row whose weights cannot be held builds no model: it records a resource skip naming the bytes
building would take and the memory there is, without allocating them (before, it logged "DOES NOT FIT" for the
reference, then built the optimized model until the kernel killed it)."""

import json

import pytest
import torch

from shapewise.cli import main
from shapewise.inputs.manifest import normalize_row, row_json
from shapewise.jobs import preflight

# batch 100 000, seq 100 000, d_model 8192, 64 heads, ffn 32768, 96 layers: 77 G parameters, ~928 GB to build
HOSTILE = normalize_row({"id": "hostile", "batch_size": 100_000, "seq_len": 100_000, "d_model": 8192,
                         "num_heads": 64, "ffn_dim": 32768, "num_layers": 96})
SMALL = normalize_row({"id": "small", "batch_size": 1, "seq_len": 8, "d_model": 16, "num_heads": 2, "ffn_dim": 32,
                       "num_layers": 1, "trials": 1})
CHUNKED = json.dumps({"batch_samples": 1, "query_block": 64, "query_samples": "all"})  # the chunked check's settings


def run_preflight(tmp_path, row):
    out = tmp_path / f"{row['id']}.json"
    assert main(["job", "preflight", "--device", "cpu", "--row", row_json(row), "--headroom", "0.85",
                 "--chunked", CHUNKED, "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture
def ram(monkeypatch):
    """This host's available RAM as the preflight reads it: 16 GiB, whatever the machine has."""
    def fake(device):
        return (16 * 2**30, 32 * 2**30)

    monkeypatch.setattr(preflight, "free_memory_bytes", fake)


def test_row_whose_weights_cannot_be_held_is_a_skip_without_building(tmp_path, monkeypatch, ram):
    def refuse(*args, **kwargs):
        raise AssertionError("the preflight built a model it had found cannot be held")

    monkeypatch.setattr(preflight, "build_optimized", refuse)
    result = run_preflight(tmp_path, HOSTILE)
    optimized = result["models"]["optimized"]
    assert optimized["fits"] is False and result["models"]["reference"]["fits"] is False
    assert "building the model takes ~927835815936 bytes of host RAM" in optimized["reason"]
    assert str(int(16 * 2**30)) in optimized["reason"]
    assert optimized["io_bytes"] == result["io_bytes"] == 2 * 100_000 * 100_000 * 8192 * 4
    assert optimized["estimate_bytes"] > optimized["io_bytes"]


def test_the_skip_reason_reaches_the_later_jobs(tmp_path, ram):
    from shapewise.jobs.io import resource_skip_reason

    result = run_preflight(tmp_path, HOSTILE)
    assert resource_skip_reason(result, "optimized").startswith("resource skip: building the model takes")


def test_a_row_that_can_be_held_is_still_planned(tmp_path, ram):
    result = run_preflight(tmp_path, SMALL)
    assert result["models"]["optimized"]["fits"] is True and "plan" in result["models"]["optimized"]


def test_build_bytes_and_the_device_budget():
    config = preflight.model_config(SMALL)
    from shapewise.model.config import parameter_count

    params = parameter_count(16, 32, 1)
    assert preflight.build_bytes(config, torch.float16, torch.device("cpu")) == (2 * params * 4 + params * 2, 0)
    assert preflight.build_bytes(config, torch.float16, torch.device("cuda")) == (2 * params * 4, params * 2)
    # on a GPU the weights must also fit the device's budget
    reason = preflight.unbuildable(config, torch.float16, torch.device("cuda"), device_budget=100, headroom=0.85)
    assert reason == (f"the model's weights take {params * 2} bytes on cuda, more than the budget of 100 bytes "
                      "(free memory x headroom 0.85)")
    assert preflight.unbuildable(config, torch.float16, torch.device("cuda"), 10**9, 0.85) is None
    assert preflight.unbuildable(config, torch.float32, torch.device("cpu"), None, 0.85) is None
