"""Manifests have stated limits, checked before any row is used: file size, UTF-8, YAML aliases, nesting, a key
written twice, at least one row, integers and tensor sizes that fit a 64-bit count, ids that fit a file name, a
padded row that pads a token. Each bad manifest gets one clear line naming the file (and row and field)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shapewise.cli import main as cli_main
from shapewise.inputs import limits, manifest, paths
from shapewise.inputs.manifest import ManifestError, load_manifest, load_manifests

ROOT = Path(__file__).resolve().parent.parent
GOOD = {"id": "r1", "batch_size": 2, "seq_len": 8, "d_model": 16, "num_heads": 2, "ffn_dim": 32, "num_layers": 1}


def refused(path):
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert all(p.startswith(str(path)) for p in info.value.problems), info.value.problems
    return "\n".join(info.value.problems)


def write_rows(tmp_path, rows):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(rows))
    return path


def write_text(tmp_path, text):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    return path


def row_text(**fields):
    return "- " + "\n  ".join(f"{k}: {v}" for k, v in {**GOOD, **fields}.items()) + "\n"


# ------------------------------------------------------------------ the file


def bomb_text():
    """A row whose description holds nine levels of nine aliases (9^9 strings once expanded): line 10 holds the
    first alias."""
    levels = ["a0: &a0 lol"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return row_text() + "  description:\n" + "".join(f"    {line}\n" for line in levels)


def test_alias_bomb_fails_fast_naming_the_line(tmp_path):
    path = write_text(tmp_path, bomb_text())
    start = time.monotonic()
    message = refused(path)
    assert time.monotonic() - start < 1
    assert "line 10, column 14: YAML alias *a0: aliases are not allowed" in message


def test_merge_key_is_an_alias_too(tmp_path):
    path = write_text(tmp_path, "- &base\n  " + row_text()[2:] + "- <<: *base\n  id: r2\n")
    assert "alias *base" in refused(path)


def test_validate_command_on_an_alias_bomb_exits_at_once(tmp_path):
    path = write_text(tmp_path, bomb_text())
    done = subprocess.run([sys.executable, "-m", "shapewise", "validate", str(path)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={"PYTHONPATH": str(ROOT / "workflow"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1 and "alias *a0" in done.stderr and str(path) in done.stderr
    assert "Traceback" not in done.stderr


def test_key_written_twice_names_file_row_and_key(tmp_path):
    path = write_text(tmp_path, row_text() + "  route: auto\n  route: fused\n")
    message = refused(path)
    assert "row 'r1'" in message and "key 'route' written twice" in message and "lines 8 and 9" in message


def test_nesting_deeper_than_the_limit(tmp_path):
    path = write_text(tmp_path, row_text(description="[" * 200 + "]" * 200))
    assert f"nested deeper than {limits.MAX_YAML_DEPTH} levels" in refused(path)


def test_binary_manifest_names_the_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    message = refused(path)
    assert "not UTF-8 text (byte 0 is 0x89)" in message and "UnicodeDecodeError" not in message


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le"])
def test_utf16_or_utf32_text_without_a_bom_names_the_file(tmp_path, encoding):
    """Without a BOM such text decodes as UTF-8 (ASCII and NUL bytes); YAML's reader then raised a ReaderError."""
    path = tmp_path / "m.yaml"
    path.write_bytes(row_text().encode(encoding))
    message = refused(path)
    assert "is 0x00: UTF-16 or UTF-32 text? save it as UTF-8" in message and "ReaderError" not in message
    done = subprocess.run([sys.executable, "-m", "shapewise", "validate", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "UTF-16 or UTF-32 text?" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def test_a_character_yaml_refuses_is_named_with_the_file(tmp_path):
    path = write_text(tmp_path, row_text(description="bell \x07"))
    assert "not valid YAML: unacceptable character #x0007" in refused(path)


def test_latin1_text_names_the_byte(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_bytes(row_text(description="caf\xe9").encode("latin-1"))
    assert "not UTF-8 text" in refused(path)


def test_file_larger_than_the_limit(tmp_path):
    path = write_text(tmp_path, row_text() + "#" * limits.MAX_YAML_BYTES + "\n")
    assert f"larger than the {limits.MAX_YAML_BYTES} bytes" in refused(path)


@pytest.mark.parametrize("make", ["directory", "device"])
def test_not_a_regular_file(tmp_path, make):
    path = tmp_path / "dir.yaml" if make == "directory" else Path("/dev/zero")
    if make == "directory":
        path.mkdir()
    message = refused(path)
    assert ("is a directory" if make == "directory" else "not a regular file") in message


def test_two_documents(tmp_path):
    path = write_text(tmp_path, row_text() + "---\n" + row_text(id="r2"))
    message = refused(path)
    assert "not valid YAML" in message and "single document" in message


def test_manifest_selected_twice(tmp_path):
    path = write_rows(tmp_path, [GOOD])
    with pytest.raises(ManifestError) as info:
        load_manifests([path, tmp_path / "." / "m.yaml"])
    assert "selected twice" in str(info.value)


# ------------------------------------------------------------------ the rows


@pytest.mark.parametrize("text, says", [("[]\n", "no rows"), ("", "is empty"), ("# nothing\n", "is empty"),
                                        ("rows:\n- id: r1\n", "list of rows, got dict"),
                                        ("r1\n", "list of rows, got str")])
def test_no_rows(tmp_path, text, says):
    assert says in refused(write_text(tmp_path, text))


@pytest.mark.parametrize("field", ["batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers"])
def test_integer_beyond_a_64_bit_count(tmp_path, field):
    path = write_text(tmp_path, row_text(**{field: 99999999999999999999999}))
    message = refused(path)
    assert f"row 'r1': field {field}: 99999999999999999999999 does not fit a signed 64-bit count" in message


def test_trials_beyond_its_maximum_names_the_maximum(tmp_path):
    maximum = manifest.load_schema()["items"]["properties"]["trials"]["maximum"]
    assert load_manifest(write_rows(tmp_path, [dict(GOOD, trials=maximum)]))[0]["trials"] == maximum
    for trials in (maximum + 1, 99999999999999999999999):
        message = refused(write_text(tmp_path, row_text(trials=trials)))
        assert f"row 'r1': field trials: {trials} is greater than the maximum of {maximum}" in message


def test_tensor_beyond_a_64_bit_count_names_its_fields(tmp_path):
    path = write_rows(tmp_path, [dict(GOOD, batch_size=10**9, seq_len=10**6, d_model=64, num_heads=64)])
    message = refused(path)
    assert "fields batch_size, num_heads, seq_len" in message and "attention scores" in message
    assert "64000000000000000000000 elements" in message


def test_weights_beyond_a_64_bit_count(tmp_path):
    path = write_rows(tmp_path, [dict(GOOD, d_model=2**30, num_heads=1, ffn_dim=2**30, num_layers=2**20)])
    assert "FFN weights" in refused(path)


def test_a_row_that_cannot_fit_but_counts_in_64_bits_is_valid(tmp_path):
    """The preflight makes it a resource skip (tests/test_safety_preflight.py); the manifest takes it."""
    row = dict(GOOD, batch_size=100000, seq_len=100000, d_model=8192, num_heads=64, ffn_dim=32768, num_layers=96)
    assert load_manifest(write_rows(tmp_path, [row]))[0]["d_model"] == 8192


def test_number_field_given_a_huge_integer(tmp_path):
    path = write_text(tmp_path, row_text(input_scale="1" + "0" * 400))
    assert "field input_scale: must be a finite number, got an integer of 401 digits" in refused(path)


def test_id_length_limit_comes_from_the_longest_file_name():
    """Derived from shapewise.inputs.paths: the longest name of a row's files is `<id>.json` (5 more characters)."""
    longest = max(len(Path(p).name) for p in paths.per_shape("x").values() if "x" in Path(p).name)
    assert manifest.id_length_limit() == limits.NAME_MAX - (longest - 1) == 250


def test_id_at_the_limit_is_taken_and_one_more_is_refused(tmp_path):
    limit = manifest.id_length_limit()
    ok = "r" + "".join(f"{i % 10}x" for i in range(limit))[: limit - 1]
    assert len(load_manifest(write_rows(tmp_path, [dict(GOOD, id=ok)]))[0]["id"]) == limit
    message = refused(write_rows(tmp_path, [dict(GOOD, id=ok + "z")]))
    assert f"{limit + 1} characters, more than the {limit}" in message


def test_id_ending_in_a_periodic_part(tmp_path):
    """Snakemake refuses such a wildcard value (PeriodicWildcardError) after planning; the manifest says it first."""
    message = refused(write_rows(tmp_path, [dict(GOOD, id="row-" + "ab" * 20)]))
    assert "ends in 'ab' repeated 20 times" in message
    assert load_manifest(write_rows(tmp_path, [dict(GOOD, id="row-" + "ab" * 19)]))


def test_periodic_rule_is_snakemakes():
    from snakemake.io import PeriodicityDetector

    detector = PeriodicityDetector()
    for value in ["a" * 19, "a" * 20, "x-" + "ab" * 20, "ab" * 19 + "c", "official-01", "q" + "abc" * 25]:
        assert (detector.is_periodic(value) is not None) == bool(manifest._PERIODIC.search(value)), value


@pytest.mark.parametrize("row_id", ["<script>alert(1)</script>", "a/b", "../up", "a\\b", ".hidden", "-dash",
                                    "a b", "tab\tid", "", "x.json", "caf\u00e9"])
def test_id_with_markup_or_path_separators(tmp_path, row_id):
    assert "field id" in refused(write_rows(tmp_path, [dict(GOOD, id=row_id)]))


def test_id_with_a_trailing_newline(tmp_path, capsys):
    """A pattern's `$` matches before a final newline in Python's re.search (the schema validator's): "tiny-1\\n"
    would pass and then break the file names and wildcards the pipeline makes of it."""
    path = write_rows(tmp_path, [dict(GOOD, id="tiny-1\n")])
    assert "row 'tiny-1\\n': field id: 'tiny-1\\n' does not match" in refused(path)
    assert cli_main(["validate", str(path)]) == 1
    assert f"{path}: row 'tiny-1\\n': field id" in capsys.readouterr().err
    assert load_manifest(write_rows(tmp_path, [dict(GOOD, id="tiny-1")]))


@pytest.mark.parametrize("field", ["batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers"])
@pytest.mark.parametrize("value", [0, -1])
def test_zero_or_negative_count(tmp_path, field, value):
    assert f"field {field}" in refused(write_rows(tmp_path, [dict(GOOD, **{field: value})]))


@pytest.mark.parametrize("field, value", [("trials", 2.5), ("trials", "5"), ("target_ms", -1), ("target_ms", 0),
                                          ("input_scale", 0), ("causal", "yes"), ("pass_mask", 1)])
def test_wrong_value_names_the_field(tmp_path, field, value):
    assert f"row 'r1': field {field}" in refused(write_rows(tmp_path, [dict(GOOD, **{field: value})]))


def test_padded_row_that_pads_no_token(tmp_path):
    message = refused(write_rows(tmp_path, [dict(GOOD, seq_len=1, padding_ratio=0.4)]))
    assert "row 'r1': field padding_ratio: padding_ratio 0.4 of seq_len 1 pads no token" in message
    # the smallest ratio that can pad one token of 8 is taken
    assert load_manifest(write_rows(tmp_path, [dict(GOOD, seq_len=8, padding_ratio=0.07)]))


def test_shortest_valid_length_is_the_models_length_rule():
    import torch

    from shapewise.model import padding_lengths

    for seq_len in (1, 2, 3, 7, 8, 100, 1023):
        for ratio in (0.01, 0.05, 0.1, 0.4, 0.5, 0.51, 0.9, 0.99):
            lengths = padding_lengths(seq_len, ratio, 4000, torch.Generator().manual_seed(0))
            assert int(lengths.min()) == manifest.shortest_valid_length(seq_len, ratio), (seq_len, ratio)


def test_every_problem_of_a_hostile_manifest_at_once(tmp_path):
    rows = [dict(GOOD, batch_size=10**30), dict(GOOD, id="r2", seq_len=1, padding_ratio=0.4),
            dict(GOOD, id="r3", trials=1.5), dict(GOOD, id="a" * 300)]
    message = refused(write_rows(tmp_path, rows))
    for hit in ("row 'r1': field batch_size", "row 'r2': field padding_ratio", "row 'r3': field trials",
                "300 characters"):
        assert hit in message, hit
