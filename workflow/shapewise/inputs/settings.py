"""The pipeline's configuration beside Snakemake's own validation: its schema
(workflow/shapewise/schemas/config.schema.yaml) owns every key, choice and default; the Snakefile, the rules and
the `shapewise` command ask this module.

Nothing here imports torch: the Snakefile calls it on every `snakemake` call.
"""

from __future__ import annotations

import difflib
import functools
import os

import yaml

from shapewise.inputs import paths


@functools.cache
def schema() -> dict:
    return yaml.safe_load(paths.CONFIG_SCHEMA.read_text())


def devices() -> tuple[str, ...]:
    """The device choices (config `device`, SHAPEWISE_DEVICE, a job's --device), as the schema lists them."""
    return tuple(schema()["properties"]["device"]["enum"])


def unknown_keys(config) -> str | None:
    """One line naming the keys of `config` the schema does not know (each with its closest known key, for a typo
    on --config), or None. The schema's own error would print the whole schema and config after it."""
    known = sorted(schema()["properties"])
    problems = []
    for key in sorted(set(config) - set(known)):
        close = difflib.get_close_matches(key, known, n=1)
        problems.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if not problems:
        return None
    return (f"unknown config key {', '.join(problems)} in --config or {paths.CONFIG_FILE}; "
            f"the keys are: {', '.join(known)}")


def pass_env(names, environ=None) -> dict:
    """{NAME: value} of the variables config `pass_env` names (a list, or from `--config pass_env=A,B` a
    comma-separated string) that are set in `environ` (default os.environ), in the config's order. A name that is
    not set is left out: the job sees it unset, as the shell does."""
    environ = os.environ if environ is None else environ
    if isinstance(names, str):
        names = names.split(",")
    return {name: environ[name] for name in names or [] if name in environ}


def _resolve(node: dict) -> dict:
    """`node` with a local `$ref` (#/definitions/NAME) followed."""
    ref = node.get("$ref") if isinstance(node, dict) else None
    if isinstance(ref, str) and ref.startswith("#/definitions/"):
        return schema()["definitions"][ref.rsplit("/", 1)[1]]
    return node if isinstance(node, dict) else {}


def _types(node: dict) -> set:
    """The JSON types a schema node takes; empty where it does not say (or says it through oneOf/anyOf alone)."""
    node = _resolve(node)
    kinds = node.get("type")
    if kinds is None:
        alternatives = node.get("oneOf") or node.get("anyOf") or []
        found = set()
        for alternative in alternatives:
            sub = _types(alternative)
            if not sub:
                return set()
            found |= sub
        return found
    return {kinds} if isinstance(kinds, str) else set(kinds)


def value_problems(config) -> list[str]:
    """What Snakemake's schema check would report unclearly: a key left empty on the command line
    (`--config shapes=`), and text where the schema wants a number or a boolean inside a mapping (Snakemake reads
    every value inside a `--config key={...}` mapping as text). One line each, naming the key."""
    problems = []
    stack = [((key,), value, schema()["properties"].get(key, {})) for key, value in config.items()]
    while stack:
        where, value, node = stack.pop()
        name = ".".join(where)
        kinds = _types(node)
        if value is None and kinds and "null" not in kinds:
            problems.append(f"config {name} is empty (e.g. `--config {name}=`): give it a value; "
                            f"{_resolve(node).get('description', 'see ' + str(paths.CONFIG_SCHEMA)).strip()}")
        elif isinstance(value, str) and kinds and "string" not in kinds and kinds & {"number", "integer", "boolean"}:
            wanted = " or ".join(sorted(kinds & {"number", "integer", "boolean"}))
            problems.append(f"config {name}: {value!r} is text where {'an' if wanted[0] == 'i' else 'a'} {wanted} is "
                            f"expected: "
                            f"Snakemake reads the values inside a --config mapping as text; put nested values in a "
                            f"YAML file and pass it with --configfile FILE")
        elif isinstance(value, dict):
            props = _resolve(node).get("properties", {})
            stack.extend(((*where, key), sub, props.get(key, {})) for key, sub in value.items())
    return sorted(problems)
