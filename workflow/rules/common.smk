# Parse-time helpers: device choice, manifest loading and validation, the
# digests that decide what reruns, the SHAPEWISE_* variables passed to the
# jobs, and the job command line.
#
# Nothing here may depend on where the checkout lies: a params value, an input
# path or a rule's shell command (before formatting) that held an absolute
# path would rerun every job of a checkout moved or copied elsewhere.
#
# Nothing here imports torch (it would cost seconds on every `snakemake` call).

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

from shapewise import inventory as sw_inventory
from shapewise import manifest as sw_manifest
from shapewise import paths as sw_paths

BASEDIR = Path(workflow.basedir).resolve()

wildcard_constraints:
    shape="[A-Za-z0-9][A-Za-z0-9_-]*",
    kind="environment|implementation",


def _has_cuda_gpu():
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and "GPU" in done.stdout


# DEVICE_ARG is what the jobs get: cuda or cpu when the user says so
# (SHAPEWISE_DEVICE or config `device`), else auto, which each job resolves on
# the node it runs on (torch.cuda.is_available()). This keeps every job's
# command line and params the same whether Snakemake parses this file on a
# GPU node or on a cluster's login node. DEVICE (this machine's guess) only
# picks the default manifests.
DEVICE_ARG = os.environ.get("SHAPEWISE_DEVICE") or config.get("device", "auto")
if DEVICE_ARG not in ("auto", "cuda", "cpu"):
    raise WorkflowError(f"SHAPEWISE_DEVICE / config device must be auto, cuda or cpu, got {DEVICE_ARG!r}")
DEVICE = DEVICE_ARG if DEVICE_ARG != "auto" else ("cuda" if _has_cuda_gpu() else "cpu")


def _manifest_names():
    chosen = config.get("shapes", "auto")
    if chosen == "auto":
        return ["official", "contract"] if DEVICE == "cuda" else ["smoke"]
    if isinstance(chosen, str):
        return [name for name in chosen.split(",") if name]
    return list(chosen)


MANIFESTS = [sw_paths.manifest(name) for name in _manifest_names()]
try:
    ROWS = {row["id"]: row for row in sw_manifest.load_manifests(MANIFESTS)}
except sw_manifest.ManifestError as exc:
    raise WorkflowError(str(exc)) from None
SHAPES = list(ROWS)
ROW_JSON = {sid: sw_manifest.row_json(row) for sid, row in ROWS.items()}


def row_param(wildcards):
    if wildcards.shape not in ROW_JSON:
        raise WorkflowError(
            f"shape {wildcards.shape!r} is not a row of the selected manifests {MANIFESTS}; "
            "pick manifests with --config shapes=<name>"
        )
    return ROW_JSON[wildcards.shape]


# Digests that decide reruns through Snakemake's params trigger: the files
# under results/fingerprint/ are rewritten only when these change. The
# environment digest covers the software (the same on a login node and on
# the compute nodes sharing its file system); the hardware each result came
# from is recorded by the job itself and separates machines in the report.
ENV_DIGEST = sw_inventory.digest_of(sw_inventory.software_environment())
IMPL_DIGEST = sw_inventory.implementation(BASEDIR)["digest"]
DIGESTS = {"environment": ENV_DIGEST, "implementation": IMPL_DIGEST}
# The measuring code itself: editing it reruns the measurements, editing the
# report code does not.
HARNESS_FILES = sorted((BASEDIR / "workflow" / "shapewise" / "jobs").glob("*.py")) + [
    BASEDIR / "workflow" / "shapewise" / "roofline.py"]
HARNESS_DIGEST = sw_inventory.digest_of({p.name: sw_inventory.sha256_file(p) for p in HARNESS_FILES if p.is_file()})

FINGERPRINTS = dict(sw_paths.FINGERPRINTS)


# SHAPEWISE_* variables of this shell that the jobs keep (config pass_env);
# shapewise.cli removes every other one inside the job. Each is passed as
# `--env NAME=VALUE`, and the whole string is a params value of every
# measuring job, so setting, changing or unsetting one reruns them. A name
# not set in this shell is not passed (the job sees it unset, as the shell).
def _pass_env_args():
    names = config.get("pass_env") or []
    if isinstance(names, str):  # --config pass_env=A,B
        names = names.split(",")
    args = []
    for name in names:
        if name in os.environ:
            args.append("--env " + shlex.quote(f"{name}={os.environ[name]}"))
    return " ".join(args)


PASS_ENV = _pass_env_args()


def device_settings(section, shape=None):
    """The config entries of `section` (cuda and cpu) as canonical JSON; the
    job takes the one of the device it runs on. A heavy row (config `heavy`)
    gets the shorter GPU protocol of `heavy.<section>`."""
    settings = dict(config[section])
    if shape is not None and _is_heavy(shape) and section in config["heavy"]:
        settings["cuda"] = config["heavy"][section]
    return json.dumps(settings, sort_keys=True)


def protocol_of(section):
    """device_settings(section) per shape, as a params function."""
    return lambda wildcards: device_settings(section, wildcards.shape)


def _is_heavy(shape):
    from shapewise import roofline

    row = ROWS.get(shape)
    return row is not None and roofline.flops(**row)["total"] >= config["heavy"]["min_gflop"] * 1e9


def row_priority(wildcards):
    """Cheaper rows first (higher priority runs first): a run stopped early (a time limit, a GPU gone) has
    finished the most rows it could. Priority = -log2(FLOPs of one forward)."""
    from shapewise import roofline

    row = ROWS.get(wildcards.shape)
    return -math.log2(max(2.0, roofline.flops(**row)["total"])) if row is not None else 0


def res(name):
    """A resource function: config resources.default, or heavy.resources for a heavy row."""

    def pick(wildcards):
        if _is_heavy(getattr(wildcards, "shape", "")):
            return config["heavy"]["resources"][name]
        return config["resources"]["default"][name]

    return pick


# The job command: our package, from this checkout, with the Python that runs
# Snakemake. A job that resolves to the CPU switches on TRITON_INTERPRET=1
# itself (shapewise.cli) before anything imports triton.
_env = f"PYTHONPATH={shlex.quote(str(BASEDIR / 'workflow'))}${{PYTHONPATH:+:$PYTHONPATH}}"
JOB = f"{_env} {shlex.quote(sys.executable)} -m shapewise job"


def per_shape_outputs(shape):
    return list(sw_paths.per_shape(shape).values())
