"""Shape manifests: loading, schema validation, cross-field checks, defaults.

A manifest is a YAML list of rows (see workflow/shapewise/schemas/shapes.schema.yaml).
Every problem is reported as "<file>: row <id>: field <name>: <what is wrong>"
and all problems of all files are collected before raising, so a user fixes
them in one go. Nothing here imports torch: Snakemake calls it at parse time.

Who owns what: the schema owns the fields, their types, ranges and defaults;
this module owns the enums DTYPES and MASKS (shapewise.jobs.inputs maps
DTYPES to torch dtypes), shapewise.model.routing owns the route names. The
enums are written into the schema when it is loaded, so one validation pass
checks them all. Integers must be written as integers (2, not 2.0) and every
number must be finite (no .nan, no .inf).

Limits checked before anything else (shapewise.inputs.limits owns the numbers): the
file's size, UTF-8, nesting depth, no YAML alias and no key written twice in
a row (shapewise.inputs.limits.load_yaml); at least one row; every integer fits a
signed 64-bit count, and so does every tensor a row's models allocate
(TENSORS, at most limits.TENSOR_ELEMENTS_MAX elements); an id fits in every
file name the pipeline makes of it (id_length_limit, from shapewise.inputs.paths)
and does not end in a part repeated PERIODIC_REPEATS times (Snakemake refuses
such a wildcard value as a sign of a cyclic rule); a padded row can pad at
least one token.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from pathlib import Path, PurePosixPath

import jsonschema
import yaml

from shapewise.inputs import limits, paths
from shapewise.inputs.paths import OFFICIAL_MANIFEST as OFFICIAL_PATH
from shapewise.inputs.paths import SHAPES_SCHEMA as SCHEMA_PATH
from shapewise.model.routing import ROUTES

SIZE_FIELDS = ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers")
MODEL_FIELDS = SIZE_FIELDS + ("causal",)
DTYPES = ("float32", "float16", "bfloat16")
MASKS = ("none", "prefix", "left", "holes")
# The enums of a row, each from its owner; load_schema() writes them into the schema.
ENUMS = {"dtype": DTYPES, "mask": MASKS, "route": ("auto",) + tuple(ROUTES)}
# Fields that describe a row without changing its results: left out of row_json.
NON_IDENTITY_FIELDS = ("manifest", "description", "target_ms")
# The largest tensors a row's models allocate, as products of its fields: the input and output, the FFN's
# activations, the reference's attention scores, the weights of all layers.
TENSORS = {
    "x [batch_size, seq_len, d_model]": ("batch_size", "seq_len", "d_model"),
    "FFN activations [batch_size, seq_len, ffn_dim]": ("batch_size", "seq_len", "ffn_dim"),
    "attention scores [batch_size, num_heads, seq_len, seq_len]": ("batch_size", "num_heads", "seq_len", "seq_len"),
    "FFN weights [num_layers, d_model, ffn_dim]": ("num_layers", "d_model", "ffn_dim"),
    "attention weights [num_layers, d_model, d_model]": ("num_layers", "d_model", "d_model"),
}
# Snakemake's PeriodicityDetector refuses a wildcard value that ends in one part repeated this many times.
PERIODIC_REPEATS = 20
_PERIODIC = re.compile(r"(.+?)\1{%d,}\Z" % (PERIODIC_REPEATS - 1))


def _is_integer(checker, instance):
    return isinstance(instance, int) and not isinstance(instance, bool)


def _is_finite_number(checker, instance):
    if not isinstance(instance, (int, float)) or isinstance(instance, bool):
        return False
    try:
        return math.isfinite(instance)
    except OverflowError:  # an integer beyond a float's range
        return False


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
    if error.validator == "type" and isinstance(value, int) and not isinstance(value, bool):
        return f"must be a finite number, got an integer of {len(str(abs(value)))} digits"
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


@functools.lru_cache(maxsize=None)
def id_length_limit():
    """The longest row id whose every file name fits limits.NAME_MAX: NAME_MAX less the most that any file name
    of a row (a result, a profile file, a log: shapewise.inputs.paths) adds to the id. The jobs write a result through
    a temporary name that does not contain the id (shapewise.jobs.io.write_result)."""
    probe = "{shape}"
    names = [*paths.per_shape(probe).values(), *paths.profile_extra(probe).values(),
             *(paths.log(step, probe) for step in paths.SHAPE_STEPS)]
    added = max(len(part) - len(probe) for name in names for part in PurePosixPath(name).parts if probe in part)
    return limits.NAME_MAX - added


def _size_problems(row, source, schema):
    """Integers and tensor sizes beyond what a 64-bit count holds, and ids no file name can hold."""
    name = f"row {row['id']!r}"
    problems = []
    for field, spec in schema["items"]["properties"].items():
        value = row.get(field)
        if spec.get("type") == "integer" and isinstance(value, int) and value > limits.COUNT_MAX:
            problems.append(f"{source}: {name}: field {field}: {value} does not fit a signed 64-bit count "
                            f"(at most {limits.COUNT_MAX})")
    if not problems:
        for tensor, fields in TENSORS.items():
            elements = math.prod(row[f] for f in fields)
            if elements > limits.TENSOR_ELEMENTS_MAX:
                problems.append(
                    f"{source}: {name}: fields {', '.join(dict.fromkeys(fields))}: the {tensor} would hold "
                    f"{' x '.join(str(row[f]) for f in fields)} = {elements} elements, more than the "
                    f"{limits.TENSOR_ELEMENTS_MAX} whose bytes a 64-bit count holds")
    longest = id_length_limit()
    if len(row["id"]) > longest:
        problems.append(f"{source}: row {row['id'][:40] + '...'!r}: field id: {len(row['id'])} characters, more than "
                        f"the {longest} that fit in a file name with the suffixes the pipeline adds "
                        f"({limits.NAME_MAX} bytes)")
    elif (periodic := _PERIODIC.search(row["id"])) is not None:
        problems.append(f"{source}: {name}: field id: ends in {periodic.group(1)!r} repeated "
                        f"{len(periodic.group(0)) // len(periodic.group(1))} times; Snakemake refuses a wildcard "
                        f"value ending in a part repeated {PERIODIC_REPEATS} times or more")
    return problems


def shortest_valid_length(seq_len, padding_ratio):
    """The fewest valid tokens a padded row's batch element may get: the length rule of
    shapewise.model.cases.padding_lengths (lengths drawn in [max(1, round(S * (1 - p))), S]), here without torch."""
    return max(1, round(seq_len * (1.0 - padding_ratio)))


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
    elif row["padding_ratio"] > 0 and shortest_valid_length(row["seq_len"], row["padding_ratio"]) >= row["seq_len"]:
        problems.append(
            f"{source}: {name}: field padding_ratio: padding_ratio {row['padding_ratio']} of seq_len "
            f"{row['seq_len']} pads no token (valid lengths are drawn in [max(1, round(seq_len * (1 - "
            f"padding_ratio))), seq_len] = [{row['seq_len']}, {row['seq_len']}]); raise seq_len or padding_ratio, "
            f"or write padding_ratio: 0")
    if not row["pass_mask"] and row["padding_ratio"] > 0:
        problems.append(f"{source}: {name}: field pass_mask: pass_mask false calls model(x) without a mask, "
                        f"but padding_ratio {row['padding_ratio']} > 0 needs one")
    return problems


def parse_rows(rows, source="<manifest>", schema=None):
    """Validate already-loaded rows; return them normalized or raise ManifestError."""
    schema = schema or load_schema()
    if rows is None:
        raise ManifestError([f"{source}: the manifest is empty; it must be a YAML list of rows"])
    if not isinstance(rows, list):
        raise ManifestError(_schema_problems(rows, source, schema))
    if not rows:
        raise ManifestError([f"{source}: the manifest has no rows (an empty list); it needs at least one"])
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
        size_problems = _size_problems(row, source, schema)
        problems += size_problems or _cross_field_problems(row, source)
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
    """The rows of one manifest file, checked (limits first, see the module docstring) and normalized."""
    path = Path(path)
    try:
        rows = limits.load_yaml(path, "manifest")
    except limits.InputFileError as exc:
        raise ManifestError([str(exc)]) from None
    return parse_rows(rows, source=str(path), schema=schema)


def official_rows(path=OFFICIAL_PATH):
    """The official table keyed by its row number (id `official-NN` -> NN), for scripts that name rows 1-14."""
    return {int(row["id"].rsplit("-", 1)[1]): row for row in load_manifest(path)}


def load_manifests(manifest_paths, schema=None):
    """Load several manifests; ids must be unique across all of them."""
    schema = schema or load_schema()
    rows, problems, owner, seen_files = [], [], {}, set()
    for path in manifest_paths:
        if Path(path).resolve() in seen_files:
            problems.append(f"{path}: manifest selected twice; name each manifest once")
            continue
        seen_files.add(Path(path).resolve())
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
