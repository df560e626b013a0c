"""`shapewise tune`: the fused kernel's launch configurations chosen from a sweep file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE = (32, 4, 1)


def record(row, cfg, ms, err=1e-3, err_masked=1e-3, error=None):
    r = {"row": row, "block_m": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2]}
    if len(cfg) > 3:
        r["kv_precompute"] = cfg[3]
    if len(cfg) > 4:
        r["key_block"], r["ffn_block"] = cfg[4], cfg[5]
    if error:
        return {**r, "error": error}
    return {**r, "ms": ms, "max_abs_error": err, "max_abs_error_masked": err_masked}


def tune(tmp_path, fused, **extra):
    sweep, policy = tmp_path / "sweep.json", tmp_path / "policy.json"
    sweep.write_text(json.dumps({"fused": fused, **extra}))
    policy.write_text((ROOT / "model" / "routing_policy.json").read_text())
    done = subprocess.run([sys.executable, "-m", "shapewise", "tune", str(sweep), str(policy)],
                          capture_output=True, text=True)
    return done, json.loads(policy.read_text())


def test_fastest_accurate_configuration_per_group(tmp_path):
    fast_wrong, fast, slow = (16, 4, 2), (16, 4, 1), (32, 4, 2)
    fused = []
    for row in (2, 12):  # small group: the fastest is inaccurate (masked), the next one wins
        fused += [record(row, BASE, 0.10), record(row, fast_wrong, 0.05, err_masked=0.5), record(row, fast, 0.07)]
    for row in (1, 7):  # mid group (8192 tokens, 4 heads): the fastest wins
        fused += [record(row, BASE, 0.10), record(row, fast, 0.08), record(row, slow, 0.09)]
    for row in (6, 11):  # large group: one configuration fails to compile on row 6
        fused += [record(row, BASE, 0.10 * (1 + 40 * (row == 6))), record(row, fast, 0.01, error="OutOfResources")
                  if row == 6 else record(row, fast, 0.01), record(row, slow, 0.09 * (1 + 40 * (row == 6)))]
    done, policy = tune(tmp_path, fused, row6_triton_layer_ms=1.0)
    assert done.returncode == 0, done.stderr
    assert policy["fused"]["launch"] == [
        {"max_tokens": 4096, "block_m": 16, "num_warps": 4, "num_stages": 1},
        {"max_tokens": 8192, "max_heads": 4, "block_m": 16, "num_warps": 4, "num_stages": 1},
        {"max_tokens": None, "block_m": 32, "num_warps": 4, "num_stages": 2}]
    before = json.loads((ROOT / "model" / "routing_policy.json").read_text())
    # row 6 fused (3.69 ms) loses to 1.0 ms: the size bound stays as committed
    assert policy["fused"]["max_tokens_x_d_model"] == before["fused"]["max_tokens_x_d_model"]
    assert policy["fused"]["max_tokens"] == before["fused"]["max_tokens"]  # the routing bounds are not its call
    assert "(rejected)" in done.stdout


def test_row6_goes_fused_when_the_fused_layer_is_faster(tmp_path):
    fused = [record(6, BASE, 2.0), record(1, BASE, 0.1)]
    done, policy = tune(tmp_path, fused, row6_triton_layer_ms=3.0)
    assert done.returncode == 0, done.stderr
    assert policy["fused"]["max_tokens_x_d_model"] >= 10000 * 128 * 128
    assert policy["fused"]["max_tokens"] is None  # or the token bound would still keep row 6 off the fused route


@pytest.mark.parametrize("broken", ["baseline", "no-common"])
def test_refuses_when_nothing_trustworthy(tmp_path, broken):
    """A failed baseline, or no configuration that qualifies on every row of a group: exit non-zero, naming
    the rows, and leave the policy as it was."""
    if broken == "baseline":
        fused = [record(1, BASE, 0.1, error="CUDA error"), record(1, (16, 4, 1), 0.05)]
        message = "baseline configuration failed on row 1"
    else:
        fused = [record(2, BASE, 0.1), record(12, (16, 4, 1), 0.1)]
        message = "no configuration qualifies on rows [2, 12]"
    done, policy = tune(tmp_path, fused)
    assert done.returncode != 0 and message in done.stderr + done.stdout
    before = json.loads((ROOT / "model" / "routing_policy.json").read_text())
    assert policy == before, "a refused tuning must leave the policy as it was"


def test_precomputed_keys_and_values_are_written_when_they_win(tmp_path):
    """A kv_precompute configuration that is fastest and as accurate lands in the policy entry; the plain ones
    carry no kv_precompute key (the routing reads its absence as False)."""
    kv = (32, 4, 2, True)
    fused = []
    for row in (2, 12):
        fused += [record(row, BASE, 0.10), record(row, (16, 4, 1), 0.07)]
    for row in (5, 11):
        fused += [record(row, BASE, 0.10), record(row, kv, 0.05)]
    done, policy = tune(tmp_path, fused)
    assert done.returncode == 0, done.stderr
    assert policy["fused"]["launch"] == [
        {"max_tokens": 4096, "block_m": 16, "num_warps": 4, "num_stages": 1},
        {"max_tokens": None, "block_m": 32, "num_warps": 4, "num_stages": 2, "kv_precompute": True}]


def test_key_and_ffn_blocks_are_written_when_they_win(tmp_path):
    """A key-blocked configuration that is fastest and as accurate lands in the policy with its block sizes; a
    sweep record of the kernel's defaults (key_block None) writes none."""
    blocked = (32, 4, 2, True, 32, 32)
    fused = []
    for row in (2, 12):
        fused += [record(row, BASE, 0.10), record(row, (16, 4, 1, False, None, None), 0.07)]
    for row in (5, 11):
        fused += [record(row, BASE, 0.10), record(row, (32, 4, 2, True), 0.06), record(row, blocked, 0.05)]
    done, policy = tune(tmp_path, fused)
    assert done.returncode == 0, done.stderr
    assert policy["fused"]["launch"] == [
        {"max_tokens": 4096, "block_m": 16, "num_warps": 4, "num_stages": 1},
        {"max_tokens": None, "block_m": 32, "num_warps": 4, "num_stages": 2, "kv_precompute": True,
         "key_block": 32, "ffn_block": 32}]
