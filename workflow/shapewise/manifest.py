"""Shape manifests: loading, schema validation, cross-field checks, defaults.

A manifest is a YAML list of rows (see workflow/schemas/shapes.schema.yaml).
Every problem is reported as "<file>: row <id>: field <name>: <what is wrong>"
and all problems of all files are collected before raising, so a user fixes
them in one go. Nothing here imports torch: Snakemake calls it at parse time.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml

from shapewise.paths import OFFICIAL_MANIFEST as OFFICIAL_PATH
from shapewise.paths import SHAPES_SCHEMA as SCHEMA_PATH

SIZE_FIELDS = ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers")
MODEL_FIELDS = SIZE_FIELDS + ("causal",)
DTYPES = ("float32", "float16", "bfloat16")
MASKS = ("none", "prefix", "left", "holes")


class ManifestError(ValueError):
    """One or more bad rows; `problems` holds one string per problem."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("invalid shape manifest:\n  " + "\n  ".join(self.problems))


def load_schema(path=SCHEMA_PATH):
    with open(path) as fh:
        return yaml.safe_load(fh)


def _row_name(row, index):
    if isinstance(row, dict) and isinstance(row.get("id"), str) and row["id"]:
        return f"row {row['id']!r}"
    return f"row #{index + 1} (no valid id)"


def _field_of(error):
    """The field a jsonschema error is about (the missing one for 'required')."""
    if error.validator == "required":
        # message looks like "'seq_len' is a required property"
        return error.message.split("'")[1] if "'" in error.message else "?"
    if error.validator == "additionalProperties":
        return ",".join(sorted(set(error.instance) - set(error.schema.get("properties", {}))))
    path = [p for p in error.path if not isinstance(p, int)]
    return str(path[0]) if path else "?"


def _schema_problems(rows, source, schema):
    problems = []
    if not isinstance(rows, list):
        return [f"{source}: the manifest must be a YAML list of rows, got {type(rows).__name__}"]
    validator = jsonschema.Draft202012Validator(schema["items"])
    for index, row in enumerate(rows):
        name = _row_name(row, index)
        if not isinstance(row, dict):
            problems.append(f"{source}: {name}: must be a mapping of fields, got {type(row).__name__}")
            continue
        for error in sorted(validator.iter_errors(row), key=lambda e: str(e.path)):
            problems.append(f"{source}: {name}: field {_field_of(error)}: {error.message}")
    return problems


def normalize_row(row):
    """A copy of a schema-valid row with every default filled in."""
    out = dict(row)
    out.setdefault("causal", True)
    out.setdefault("dtype", "float32")
    out["padding_ratio"] = float(out.get("padding_ratio", 0.0))
    out["input_scale"] = float(out.get("input_scale", 1.0))
    out.setdefault("trials", 5)
    out.setdefault("route", "auto")
    if "mask" not in out:
        out["mask"] = "prefix" if out["padding_ratio"] > 0 else "none"
    return out


def _cross_field_problems(row, source):
    """Checks a JSON schema cannot express; `row` is normalized."""
    name = f"row {row['id']!r}"
    problems = []
    if row["d_model"] % row["num_heads"] != 0:
        problems.append(
            f"{source}: {name}: field d_model: d_model % num_heads != 0 "
            f"({row['d_model']} % {row['num_heads']} = {row['d_model'] % row['num_heads']})"
        )
    if row["mask"] != "none" and row["padding_ratio"] == 0:
        problems.append(f"{source}: {name}: field mask: mask {row['mask']!r} needs padding_ratio > 0")
    if row["mask"] == "none" and row["padding_ratio"] > 0:
        problems.append(f"{source}: {name}: field mask: padding_ratio > 0 needs a mask other than 'none'")
    if row["padding_ratio"] > 0 and round(row["padding_ratio"] * row["seq_len"]) >= row["seq_len"]:
        problems.append(f"{source}: {name}: field padding_ratio: would pad every token of seq_len {row['seq_len']}")
    return problems


def parse_rows(rows, source="<manifest>", schema=None):
    """Validate already-loaded rows; return them normalized or raise ManifestError."""
    schema = schema or load_schema()
    if not isinstance(rows, list):
        raise ManifestError(_schema_problems(rows, source, schema))
    problems, normalized, seen = [], [], {}
    for index, raw in enumerate(rows):
        row_problems = _schema_problems([raw], source, schema)
        if row_problems:  # name rows by their position in this file, not in the one-row list
            row_problems = [p.replace("row #1 (no valid id)", f"row #{index + 1} (no valid id)")
                            for p in row_problems]
            problems += row_problems
            continue
        row = normalize_row(raw)
        normalized.append(row)
        problems += _cross_field_problems(row, source)
        if row["id"] in seen:
            problems.append(
                f"{source}: row {row['id']!r}: field id: duplicate id (rows #{seen[row['id']] + 1} and #{index + 1})"
            )
        seen.setdefault(row["id"], index)
    if problems:
        raise ManifestError(problems)
    for row in normalized:
        row["manifest"] = str(source)
    return normalized


def load_manifest(path, schema=None):
    path = Path(path)
    if not path.is_file():
        raise ManifestError([f"{path}: manifest file not found"])
    try:
        with open(path) as fh:
            rows = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        raise ManifestError([f"{path}: not valid YAML: {exc}"]) from exc
    return parse_rows(rows, source=str(path), schema=schema)


def official_rows(path=OFFICIAL_PATH):
    """The official table keyed by its row number (id `official-NN` -> NN), for scripts that name rows 1-14."""
    return {int(row["id"].rsplit("-", 1)[1]): row for row in load_manifest(path)}


def load_manifests(paths, schema=None):
    """Load several manifests; ids must be unique across all of them."""
    schema = schema or load_schema()
    rows, problems, owner = [], [], {}
    for path in paths:
        try:
            loaded = load_manifest(path, schema)
        except ManifestError as exc:
            problems += exc.problems
            continue
        for row in loaded:
            if row["id"] in owner:
                problems.append(
                    f"{path}: row {row['id']!r}: field id: id also used in {owner[row['id']]}; "
                    "ids must be unique across the selected manifests"
                )
            owner.setdefault(row["id"], str(path))
            rows.append(row)
    if problems:
        raise ManifestError(problems)
    return rows


def row_json(row):
    """Canonical JSON of the fields that define a row's results (not its file)."""
    fields = {k: v for k, v in row.items() if k not in ("manifest", "description")}
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))
