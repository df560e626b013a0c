"""Shape manifests: loading, schema validation, cross-field checks, defaults.

A manifest is a YAML list of rows (see workflow/schemas/shapes.schema.yaml).
Every problem is reported as "<file>: row <id>: field <name>: <what is wrong>"
and all problems of all files are collected before raising, so a user fixes
them in one go. Nothing here imports torch: Snakemake calls it at parse time.

Who owns what: the schema owns the fields, their types, ranges and defaults;
this module owns the enums DTYPES and MASKS (shapewise.jobs.inputs maps
DTYPES to torch dtypes), shapewise.model.routing owns the route names. The
enums are written into the schema when it is loaded, so one validation pass
checks them all. Integers must be written as integers (2, not 2.0) and every
number must be finite (no .nan, no .inf).
"""

from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path

import jsonschema
import yaml

from shapewise.model.routing import ROUTES
from shapewise.paths import OFFICIAL_MANIFEST as OFFICIAL_PATH
from shapewise.paths import SHAPES_SCHEMA as SCHEMA_PATH

SIZE_FIELDS = ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers")
MODEL_FIELDS = SIZE_FIELDS + ("causal",)
DTYPES = ("float32", "float16", "bfloat16")
MASKS = ("none", "prefix", "left", "holes")
# The enums of a row, each from its owner; load_schema() writes them into the schema.
ENUMS = {"dtype": DTYPES, "mask": MASKS, "route": ("auto",) + tuple(ROUTES)}
# Fields that describe a row without changing its results: left out of row_json.
NON_IDENTITY_FIELDS = ("manifest", "description", "target_ms")


def _is_integer(checker, instance):
    return isinstance(instance, int) and not isinstance(instance, bool)


def _is_finite_number(checker, instance):
    return isinstance(instance, (int, float)) and not isinstance(instance, bool) and math.isfinite(instance)


# jsonschema accepts 2.0 as an integer and NaN / infinity as numbers; a manifest may not.
_RowValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"integer": _is_integer, "number": _is_finite_number}),
)


class ManifestError(ValueError):
    """One or more bad rows; `problems` holds one string per problem."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("invalid shape manifest:\n  " + "\n  ".join(self.problems))


def load_schema(path=SCHEMA_PATH):
    """The row schema with the code's enums (ENUMS) written into it."""
    return copy.deepcopy(_load_schema(str(path)))


@functools.lru_cache(maxsize=None)
def _load_schema(path):
    with open(path) as fh:
        schema = yaml.safe_load(fh)
    properties = schema["items"]["properties"]
    for field, values in ENUMS.items():
        if field not in properties:
            raise ValueError(f"{path}: the schema has no field {field!r} for the enum {values}")
        properties[field]["enum"] = list(values)
    return schema


def schema_defaults(schema=None):
    """{field: default} from the schema's `default:` entries (the one place a default is written)."""
    schema = schema or load_schema()
    return {name: spec["default"] for name, spec in schema["items"]["properties"].items() if "default" in spec}


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


def _message(error):
    """jsonschema's message, plainer where our stricter types rejected a value."""
    value = error.instance
    if error.validator == "type" and isinstance(value, float):
        if not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if error.validator_value == "integer":
            hint = f" (write {int(value)})" if value.is_integer() else ""
            return f"must be an integer, got {value!r}{hint}"
    return error.message


def _schema_problems(rows, source, schema):
    problems = []
    if not isinstance(rows, list):
        return [f"{source}: the manifest must be a YAML list of rows, got {type(rows).__name__}"]
    validator = _RowValidator(schema["items"])
    for index, row in enumerate(rows):
        name = _row_name(row, index)
        if not isinstance(row, dict):
            problems.append(f"{source}: {name}: must be a mapping of fields, got {type(row).__name__}")
            continue
        errors = sorted(validator.iter_errors(row), key=lambda e: str(e.path))
        # a value of the wrong type gets one problem, not one per range check it also fails
        wrong_type = {_field_of(e) for e in errors if e.validator == "type"}
        for error in errors:
            field = _field_of(error)
            if error.validator == "type" or field not in wrong_type:
                problems.append(f"{source}: {name}: field {field}: {_message(error)}")
    return problems


def normalize_row(row, schema=None):
    """A copy of a schema-valid row with every default of the schema filled in.

    Numbers (`type: number`) become floats, so 0 and 0.0 give the same row_json. The mask's default depends
    on the padding: the schema's `default` without padding, its `default_when_padded` with padding_ratio > 0.
    """
    schema = schema or load_schema()
    properties = schema["items"]["properties"]
    out = dict(schema_defaults(schema))
    out.update(row)
    if "mask" not in row and out["padding_ratio"] > 0:
        out["mask"] = properties["mask"]["default_when_padded"]
    for name, spec in properties.items():
        if spec.get("type") == "number" and name in out:
            out[name] = float(out[name])
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
    if not row["pass_mask"] and row["padding_ratio"] > 0:
        problems.append(f"{source}: {name}: field pass_mask: pass_mask false calls model(x) without a mask, "
                        f"but padding_ratio {row['padding_ratio']} > 0 needs one")
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
        row = normalize_row(raw, schema)
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
    """Canonical JSON of the fields that define a row's results (not its file, description or target)."""
    fields = {k: v for k, v in row.items() if k not in NON_IDENTITY_FIELDS}
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))
