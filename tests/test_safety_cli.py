"""Commands given a missing, damaged or malformed file say which and what, and exit non-zero without a traceback:
`shapewise gpus check`, `shapewise tune`, `shapewise targets`, `shapewise validate`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shapewise.cli import main

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "model" / "routing_policy.json"
GOOD_RECORD = {"row": 1, "block_m": 32, "num_warps": 4, "num_stages": 1, "ms": 0.1, "max_abs_error": 1e-3,
               "max_abs_error_masked": 1e-3}


def shapewise(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "shapewise", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120, env={"PYTHONPATH": str(ROOT / "workflow"), "PATH": "/usr/bin:/bin"})


# ------------------------------------------------------------------ gpus check


def test_gpus_check_names_a_missing_directory(tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    assert main(["gpus", "check", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"{missing} does not exist" in err and "0 GPU job results" not in err


def test_gpus_check_names_a_file_that_is_not_a_directory(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text("{}")
    assert main(["gpus", "check", str(path)]) == 2
    assert f"{path} is not a directory" in capsys.readouterr().err


# ------------------------------------------------------------------ tune


@pytest.fixture
def policy(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(POLICY.read_text())
    return path


def sweep(tmp_path, content):
    path = tmp_path / "sweep.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def tune_refuses(sweep_path, policy_path):
    before = Path(policy_path).read_bytes() if Path(policy_path).is_file() else None
    with pytest.raises(SystemExit) as info:
        main(["tune", str(sweep_path), str(policy_path)])
    if before is not None:
        assert Path(policy_path).read_bytes() == before, "a refused tuning must leave the policy as it was"
    return str(info.value)


def test_tune_on_a_missing_sweep(tmp_path, policy):
    assert tune_refuses(tmp_path / "nope.json", policy) == f"tune: {tmp_path / 'nope.json'}: sweep file not found"


@pytest.mark.parametrize("content, says", [
    ('{"fused": [', "not valid JSON"),
    ("\x00\x01binary", "not UTF-8 text (byte 0 is 0x00"),
    ("[]", "not a launch sweep"),
    ({"fused": []}, "not a launch sweep"),
    ({"attention": []}, "not a launch sweep"),
    ({"fused": ["x"]}, "fused record #1: a JSON object expected, got str"),
    ({"fused": [dict(GOOD_RECORD, row=99)]}, "fused record #1: field row is 99, not an official row number (1-14)"),
    ({"fused": [dict(GOOD_RECORD, row=True)]}, "field row is True"),
    ({"fused": [GOOD_RECORD, dict(GOOD_RECORD, block_m=None)]}, "fused record #2: field block_m is None"),
    ({"fused": [dict(GOOD_RECORD, num_warps=2.5)]}, "field num_warps is 2.5, not a whole number >= 1"),
    ({"fused": [dict(GOOD_RECORD, ms="fast")]}, "field ms is 'fast', not a finite number >= 0"),
    ({"fused": [{k: v for k, v in GOOD_RECORD.items() if k != "max_abs_error"}]}, "field max_abs_error is None"),
    ({"fused": [GOOD_RECORD], "row6_triton_layer_ms": -1}, "row6_triton_layer_ms is -1"),
    ('{"fused": [], "fused": []}', "key 'fused' written twice"),
])
def test_tune_on_a_damaged_or_malformed_sweep(tmp_path, policy, content, says):
    message = tune_refuses(sweep(tmp_path, content), policy)
    assert message.startswith(f"tune: {tmp_path / 'sweep.json'}") and says in message, message


def test_tune_on_a_non_utf8_sweep(tmp_path, policy):
    path = tmp_path / "sweep.json"
    path.write_bytes(b'{"fused": "\xff"}')
    assert "not UTF-8 text" in tune_refuses(path, policy)


@pytest.mark.parametrize("content, says", [(None, "routing policy file not found"), ("{", "not valid JSON"),
                                           ('{"launch": []}', "not a routing policy")])
def test_tune_on_a_missing_or_damaged_policy(tmp_path, content, says):
    path = tmp_path / "policy.json"
    if content is not None:
        path.write_text(content)
    message = tune_refuses(sweep(tmp_path, {"fused": [GOOD_RECORD]}), path)
    assert str(path) in message and says in message


def test_tune_on_a_policy_that_cannot_be_written(tmp_path, policy, monkeypatch):
    from shapewise import tune

    def read_only(path, mode="r", *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(tune, "open", read_only, raising=False)  # the write, as on a read-only file system
    message = tune_refuses(sweep(tmp_path, {"fused": [GOOD_RECORD]}), policy)
    assert message == f"tune: {policy}: cannot be written (Permission denied)"


def test_tune_command_prints_no_traceback(tmp_path, policy):
    done = shapewise("tune", tmp_path / "missing.json", policy)
    assert done.returncode == 1 and "sweep file not found" in done.stderr and "Traceback" not in done.stderr


# ------------------------------------------------------------------ targets and validate


@pytest.mark.parametrize("row_id", ["../../etc", "a/b", "", "<b>"])
def test_targets_refuses_what_is_not_a_row_id(row_id, capsys):
    assert main(["targets", "ok-1", row_id]) == 2
    err = capsys.readouterr().err
    assert repr(row_id) in err and "not a row id" in err


def test_validate_on_a_binary_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_bytes(bytes(range(256)))
    done = shapewise("validate", path)
    assert done.returncode == 1 and f"{path}: not UTF-8 text" in done.stderr and "Traceback" not in done.stderr
