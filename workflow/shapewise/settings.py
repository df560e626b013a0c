"""The pipeline's configuration beside Snakemake's own validation: its schema (workflow/schemas/config.schema.yaml)
owns every key, choice and default; the Snakefile, the rules and the `shapewise` command ask this module.

Nothing here imports torch: the Snakefile calls it on every `snakemake` call.
"""

from __future__ import annotations

import difflib
import functools
import os

import yaml

from shapewise import paths


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
