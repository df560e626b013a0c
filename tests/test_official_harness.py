"""benchmarks/official_harness.py on the CPU: what it reads of the official table, and its refusal without CUDA."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "official_harness.py"
FIELDS = ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers")


def test_every_official_row_has_the_fields_the_harness_builds_a_model_from():
    table = yaml.safe_load((ROOT / "shapes" / "official.yaml").read_text())
    assert len(table) == 14
    for row in table:
        assert all(isinstance(row[name], int) for name in FIELDS), row["id"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA gets")
def test_refuses_without_cuda(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "out.json"), "--rows", "2"],
                         capture_output=True, text=True)
    assert run.returncode != 0
    assert "needs a CUDA device" in run.stderr
    assert not (tmp_path / "out.json").exists()
