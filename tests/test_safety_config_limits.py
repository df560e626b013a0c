"""The limits of the YAML the pipeline reads besides manifests: a config loaded by Snakemake (whose loader keeps
aliases) is checked by shapewise.inputs.limits.check_loaded, which stops an alias bomb after a bounded number of steps;
the shipped config and manifests pass the strict reader (shapewise.inputs.limits.load_yaml). The config schema's
patterns refuse a value ending in a newline, and its `commit` is a full commit id, the one verify can check."""

import time
from pathlib import Path

import pytest
import yaml

from shapewise.inputs import limits, paths
from shapewise.provenance import provenance

ROOT = Path(__file__).resolve().parent.parent
# Five levels of thirty aliases: 30^5 = 24 300 000 strings once expanded, seven levels deep.
BOMB = "".join(["a0: &a0 [lol]\n"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 30)}]\n" for i in range(1, 5)])


@pytest.mark.parametrize("loader", [yaml.BaseLoader, yaml.SafeLoader], ids=["--config", "--configfile"])
def test_alias_bomb_loaded_by_snakemake_stops_fast(loader):
    """`--config KEY=VALUE` values are parsed with YAML's BaseLoader, config files with a safe loader; both keep
    an alias as one shared node, so loading is cheap and walking it is not."""
    value = yaml.load(BOMB, Loader=loader)
    start = time.monotonic()
    with pytest.raises(limits.InputFileError, match=r"^config: more than 10000 values once expanded"):
        limits.check_loaded(value, "config")
    assert time.monotonic() - start < 1


def test_deep_config_is_refused():
    value = []
    for _ in range(20):
        value = [value]
    with pytest.raises(limits.InputFileError, match="nested deeper than 8 levels"):
        limits.check_loaded({"timing": value}, "config/config.yaml")


def test_shipped_config_is_within_the_limits():
    config = limits.load_yaml(ROOT / "config" / "config.yaml", "config")
    limits.check_loaded(config, "config/config.yaml")


@pytest.mark.parametrize("path", [ROOT / "config" / "config.yaml", *sorted((ROOT / "shapes").glob("*.yaml"))],
                         ids=lambda p: p.name)
def test_shipped_yaml_passes_the_strict_reader(path):
    assert limits.load_yaml(path, "file") is not None


def config_error(**values):
    """The message of the Snakefile's schema check (snakemake.utils.validate) of the shipped config with `values`
    over it, or None when it passes."""
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    config = dict(limits.load_yaml(ROOT / "config" / "config.yaml", "config"), **values)
    try:
        validate(config, str(paths.CONFIG_SCHEMA))
    except WorkflowError as exc:
        return str(exc)
    return None


FULL_COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize("key, value", [("shapes", "official"), ("shapes", ["official", "contract"]),
                                        ("pass_env", "SHAPEWISE_ROUTE"), ("pass_env", ["SHAPEWISE_ROUTE"]),
                                        ("commit", FULL_COMMIT), ("candidates", "mine=candidates/mine.py"),
                                        ("candidates", {"mine": "candidates/mine.py"})])
def test_value_with_a_trailing_newline_is_refused(key, value):
    """A pattern's `$` matches before a final newline in Python's re.search (the validator's); each value is taken
    as written and refused with a newline at its end, naming the key."""
    def with_newline(v):
        if isinstance(v, list):
            return [*v[:-1], v[-1] + "\n"]
        if isinstance(v, dict):
            return {name + "\n": path for name, path in v.items()}
        return v + "\n"

    assert config_error(**{key: value}) is None
    message = config_error(**{key: with_newline(value)})
    assert message is not None and f"instance[{key!r}]" in message and repr(with_newline(value)) in message


@pytest.mark.parametrize("commit", [FULL_COMMIT, FULL_COMMIT[:7], FULL_COMMIT[:39], FULL_COMMIT + "0", "a" * 64,
                                    FULL_COMMIT.upper(), "HEAD"])
def test_schema_takes_exactly_the_commits_verify_can_check(commit, tmp_path):
    """Config `commit` goes into the report's provenance; verify checks the inputs against it only when it is a
    full commit id, so the schema refuses a short one rather than let the report be checked against the working
    tree."""
    taken_by_schema = config_error(commit=commit) is None
    _, why = provenance.commit_known(tmp_path, commit)
    assert taken_by_schema == ("is not a full commit id" not in why), why
    assert taken_by_schema == (commit in (FULL_COMMIT, "a" * 64))
