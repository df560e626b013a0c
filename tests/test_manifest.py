"""Manifest validation: every kind of bad row names the file, the row and the field."""

import re
from pathlib import Path

import pytest
import yaml

from shapewise.inputs.manifest import ManifestError, load_manifest, load_manifests

ROOT = Path(__file__).resolve().parent.parent
GOOD = {"id": "r1", "batch_size": 2, "seq_len": 8, "d_model": 16, "num_heads": 2, "ffn_dim": 32, "num_layers": 1}


def write(tmp_path, rows, name="m.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(rows))
    return path


def problems_for(tmp_path, rows):
    path = write(tmp_path, rows)
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    return path, info.value.problems


def assert_named(problems, path, row_id, field):
    hits = [p for p in problems if str(path) in p and f"row {row_id!r}" in p and f"field {field}" in p]
    assert hits, f"no problem names {path} / {row_id} / {field}: {problems}"


@pytest.mark.parametrize("name", ["official", "smoke", "contract"])
def test_shipped_manifests_validate(name):
    rows = load_manifest(ROOT / "shapes" / f"{name}.yaml")
    assert rows and all(r["manifest"].endswith(f"{name}.yaml") for r in rows)


def test_official_table_has_fourteen_causal_rows():
    rows = load_manifest(ROOT / "shapes" / "official.yaml")
    assert [r["id"] for r in rows] == [f"official-{i:02d}" for i in range(1, 15)]
    assert all(r["causal"] and r["dtype"] == "float32" for r in rows)
    last = rows[-1]
    assert (last["batch_size"], last["seq_len"], last["d_model"], last["num_heads"], last["num_layers"]) == (
        32, 100000, 1024, 16, 2)


def test_shipped_manifests_have_unique_ids_together():
    rows = load_manifests([ROOT / "shapes" / f"{n}.yaml" for n in ("official", "smoke", "contract")])
    assert len({r["id"] for r in rows}) == len(rows)


def test_defaults(tmp_path):
    rows = load_manifest(write(tmp_path, [GOOD, dict(GOOD, id="r2", padding_ratio=0.5)]))
    assert rows[0]["dtype"] == "float32" and rows[0]["trials"] == 5 and rows[0]["causal"] is True
    assert rows[0]["mask"] == "none" and rows[0]["route"] == "auto" and rows[0]["input_scale"] == 1.0
    assert rows[1]["mask"] == "prefix"


@pytest.mark.parametrize("field", ["batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers"])
def test_missing_field(tmp_path, field):
    row = dict(GOOD)
    del row[field]
    path, problems = problems_for(tmp_path, [row])
    assert_named(problems, path, "r1", field)


@pytest.mark.parametrize("field", ["batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers"])
@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_size(tmp_path, field, value):
    path, problems = problems_for(tmp_path, [dict(GOOD, **{field: value})])
    assert_named(problems, path, "r1", field)


def test_heads_must_divide_d_model(tmp_path):
    path, problems = problems_for(tmp_path, [dict(GOOD, d_model=30, num_heads=4)])
    assert_named(problems, path, "r1", "d_model")
    assert any("d_model % num_heads != 0" in p for p in problems)


def test_duplicate_id(tmp_path):
    path, problems = problems_for(tmp_path, [GOOD, dict(GOOD, batch_size=4)])
    assert_named(problems, path, "r1", "id")
    assert any("duplicate" in p for p in problems)


def test_duplicate_id_across_manifests(tmp_path):
    a = write(tmp_path, [GOOD], "a.yaml")
    b = write(tmp_path, [dict(GOOD, seq_len=4)], "b.yaml")
    with pytest.raises(ManifestError) as info:
        load_manifests([a, b])
    assert_named(info.value.problems, b, "r1", "id")


@pytest.mark.parametrize("dtype", ["float64", "fp16", "int8"])
def test_unknown_dtype(tmp_path, dtype):
    path, problems = problems_for(tmp_path, [dict(GOOD, dtype=dtype)])
    assert_named(problems, path, "r1", "dtype")


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_padding_ratio_outside_range(tmp_path, ratio):
    path, problems = problems_for(tmp_path, [dict(GOOD, padding_ratio=ratio)])
    assert_named(problems, path, "r1", "padding_ratio")


def test_padding_that_removes_every_token(tmp_path):
    path, problems = problems_for(tmp_path, [dict(GOOD, seq_len=1, padding_ratio=0.99)])
    assert_named(problems, path, "r1", "padding_ratio")


def test_mask_without_padding(tmp_path):
    path, problems = problems_for(tmp_path, [dict(GOOD, mask="holes")])
    assert_named(problems, path, "r1", "mask")


def test_unknown_field_is_named(tmp_path):
    path, problems = problems_for(tmp_path, [dict(GOOD, seq_length=8)])
    assert_named(problems, path, "r1", "seq_length")


def test_row_without_id_is_named_by_position(tmp_path):
    row = dict(GOOD)
    del row["id"]
    path, problems = problems_for(tmp_path, [GOOD | {"id": "ok"}, row])
    assert any(str(path) in p and "row #2" in p and "field id" in p for p in problems), problems


def test_wildcard_unsafe_id(tmp_path):
    path, problems = problems_for(tmp_path, [dict(GOOD, id="a/b")])
    assert any("field id" in p for p in problems), problems


def test_all_problems_reported_together(tmp_path):
    rows = [dict(GOOD, seq_len=0), dict(GOOD, id="r2", dtype="x"), dict(GOOD, id="r3", d_model=30, num_heads=4)]
    path, problems = problems_for(tmp_path, rows)
    assert_named(problems, path, "r1", "seq_len")
    assert_named(problems, path, "r2", "dtype")
    assert_named(problems, path, "r3", "d_model")


def test_not_a_list(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("id: r1\n")
    with pytest.raises(ManifestError, match="list of rows"):
        load_manifest(path)


def test_missing_file(tmp_path):
    with pytest.raises(ManifestError, match="not found"):
        load_manifest(tmp_path / "nope.yaml")


def test_official_rows_by_number():
    """shapewise.inputs.manifest.official_rows: the published table keyed 1..14 (scripts name rows by number)."""
    from shapewise.inputs.manifest import official_rows

    rows = official_rows()
    assert sorted(rows) == list(range(1, 15))
    assert (rows[6]["batch_size"], rows[6]["seq_len"], rows[6]["d_model"]) == (10000, 128, 128)
    assert (rows[14]["seq_len"], rows[14]["num_heads"], rows[14]["num_layers"]) == (100000, 16, 2)


# --- one owner per fact: defaults from the schema, enums from the code ------------------------------------------

def test_defaults_come_from_the_schema():
    """normalize_row writes no default of its own: a different schema default gives a different row."""
    from shapewise.inputs.manifest import load_schema, normalize_row, schema_defaults

    schema = load_schema()
    defaults = schema_defaults(schema)
    assert {"causal", "dtype", "padding_ratio", "input_scale", "trials", "mask", "pass_mask", "route"} <= set(defaults)
    row = normalize_row(GOOD, schema)
    for field, value in defaults.items():
        assert row[field] == value, field
    schema["items"]["properties"]["trials"]["default"] = 7
    schema["items"]["properties"]["causal"]["default"] = False
    row = normalize_row(GOOD, schema)
    assert row["trials"] == 7 and row["causal"] is False


def test_schema_causal_default_is_the_models():
    import dataclasses

    from shapewise.inputs.manifest import schema_defaults
    from shapewise.model.config import TransformerConfig

    model_default = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}["causal"]
    assert schema_defaults()["causal"] is model_default


def test_input_dtypes_are_the_manifests():
    from shapewise.inputs import manifest
    from shapewise.jobs.inputs import DTYPES

    assert tuple(DTYPES) == manifest.DTYPES


def test_enums_have_one_owner():
    """The schema file writes no list of dtypes, masks or routes; the loaded schema holds the code's lists."""
    from shapewise.inputs import manifest
    from shapewise.model.routing import ROUTES

    raw = yaml.safe_load(manifest.SCHEMA_PATH.read_text())["items"]["properties"]
    assert all("enum" not in raw[field] for field in manifest.ENUMS)
    loaded = manifest.load_schema()["items"]["properties"]
    assert loaded["dtype"]["enum"] == list(manifest.DTYPES)
    assert loaded["mask"]["enum"] == list(manifest.MASKS)
    assert loaded["route"]["enum"] == ["auto", *ROUTES]
    assert raw["mask"]["default"] in manifest.MASKS and raw["mask"]["default_when_padded"] in manifest.MASKS
    assert raw["dtype"]["default"] in manifest.DTYPES and raw["route"]["default"] == "auto"


def test_manifest_module_imports_no_torch():
    """Snakemake loads manifests at parse time: importing shapewise.inputs.manifest (and the route list) costs no
    torch."""
    import subprocess
    import sys

    code = "import sys, shapewise.inputs.manifest; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT / "workflow"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr


def test_target_ms_is_not_part_of_the_rows_identity(tmp_path):
    from shapewise.inputs.manifest import row_json

    a, b = load_manifest(write(tmp_path, [dict(GOOD, target_ms=1.0), dict(GOOD, id="r2", target_ms=2.0)]))
    assert row_json(a) == row_json(dict(b, id="r1"))
    assert "target_ms" not in row_json(a)


# --- every bad value named before any job starts ------------------------------------------------------------------

@pytest.mark.parametrize("route", ["fuzed", "Triton", "auto2"])
def test_unknown_route(tmp_path, route):
    path, problems = problems_for(tmp_path, [dict(GOOD, route=route)])
    assert_named(problems, path, "r1", "route")
    assert any("fused" in p for p in problems), problems  # the message lists the routes


@pytest.mark.parametrize("mask", ["prefx", "right"])
def test_unknown_mask(tmp_path, mask):
    path, problems = problems_for(tmp_path, [dict(GOOD, padding_ratio=0.5, mask=mask)])
    assert_named(problems, path, "r1", "mask")


@pytest.mark.parametrize("route", ["auto", "reference", "sdpa", "triton", "graph", "fused"])
def test_known_routes_pass(tmp_path, route):
    assert load_manifest(write(tmp_path, [dict(GOOD, route=route)]))[0]["route"] == route


def test_validate_command_rejects_a_misspelt_route(tmp_path, capsys):
    from shapewise.cli import main

    path = write(tmp_path, [GOOD, dict(GOOD, id="r2", route="fuzed")])
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "row 'r2'" in err and "field route" in err and "fuzed" in err, err


def test_validate_command_lists_valid_rows(tmp_path, capsys):
    from shapewise.cli import main

    assert main(["validate", str(write(tmp_path, [GOOD]))]) == 0
    assert "r1:" in capsys.readouterr().out


def write_text(tmp_path, text):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    return path, info.value.problems


ROW_TEXT = "- {id: r1, batch_size: 2, seq_len: 8, d_model: 16, num_heads: 2, ffn_dim: 32, num_layers: 1, %s}\n"


@pytest.mark.parametrize("field", ["batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers",
                                   "trials"])
def test_integer_written_as_float(tmp_path, field):
    """YAML 2.0 is a float; jsonschema's integer type would take it."""
    text = re.sub(rf"\b{field}: (\d+)", rf"{field}: \1.0", ROW_TEXT % "trials: 2")
    assert f"{field}: 2.0" in text or f"{field}: 1.0" in text or re.search(rf"{field}: \d+\.0", text)
    path, problems = write_text(tmp_path, text)
    assert_named(problems, path, "r1", field)
    assert any("must be an integer" in p for p in problems), problems
    assert len(problems) == 1, problems


@pytest.mark.parametrize("field,value", [("padding_ratio", ".nan"), ("padding_ratio", ".inf"),
                                         ("input_scale", ".nan"), ("input_scale", ".inf"),
                                         ("input_scale", "-.inf"), ("target_ms", ".nan"), ("target_ms", ".inf"),
                                         ("batch_size", ".nan"), ("trials", ".inf")])
def test_nan_and_infinity(tmp_path, field, value):
    if field == "batch_size":
        text = (ROW_TEXT % "causal: true").replace("batch_size: 2", f"batch_size: {value}")
    else:
        text = ROW_TEXT % f"{field}: {value}"
    path, problems = write_text(tmp_path, text)
    assert_named(problems, path, "r1", field)
    assert len(problems) == 1, problems


def test_pass_mask_false_with_padding(tmp_path):
    path, problems = problems_for(tmp_path, [dict(GOOD, padding_ratio=0.25, pass_mask=False)])
    assert_named(problems, path, "r1", "pass_mask")
    assert load_manifest(write(tmp_path, [dict(GOOD, pass_mask=False)]))[0]["pass_mask"] is False
