# Parse-time helpers: device choice, manifest loading and validation, the
# digests that decide what reruns, and the job command line.
#
# Nothing here imports torch (it would cost seconds on every `snakemake` call).

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from shapewise import fingerprint as sw_fp
from shapewise import manifest as sw_manifest

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


def _choose_device():
    forced = os.environ.get("SHAPEWISE_DEVICE") or config.get("device", "auto")
    if forced not in ("auto", "cuda", "cpu"):
        raise ValueError(f"SHAPEWISE_DEVICE / config device must be auto, cuda or cpu, got {forced!r}")
    if forced != "auto":
        return forced
    return "cuda" if _has_cuda_gpu() else "cpu"


DEVICE = _choose_device()


def _manifest_names():
    chosen = config.get("shapes", "auto")
    if chosen == "auto":
        return ["official", "contract"] if DEVICE == "cuda" else ["smoke"]
    if isinstance(chosen, str):
        return [name for name in chosen.split(",") if name]
    return list(chosen)


MANIFESTS = [f"shapes/{name}.yaml" for name in _manifest_names()]
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
# under results/fingerprint/ are rewritten only when these change.
ENV_DIGEST = sw_fp.digest_of(sw_fp.cheap_environment())
IMPL_DIGEST = sw_fp.implementation(BASEDIR)["digest"]
DIGESTS = {"environment": ENV_DIGEST, "implementation": IMPL_DIGEST}
# The measuring code itself: editing it reruns the measurements, editing the
# report code does not.
HARNESS_FILES = sorted((BASEDIR / "shapewise" / "jobs").glob("*.py")) + [BASEDIR / "shapewise" / "roofline.py"]
HARNESS_DIGEST = sw_fp.digest_of({p.name: sw_fp.sha256_file(p) for p in HARNESS_FILES if p.is_file()})

FINGERPRINTS = {
    "env": "results/fingerprint/environment.json",
    "impl": "results/fingerprint/implementation.json",
}


def device_settings(section):
    """The config entry of `section` for this device, as canonical JSON."""
    return json.dumps(config[section][DEVICE], sort_keys=True)


def _is_large(shape):
    row = ROWS.get(shape)
    return row is not None and row["batch_size"] * row["seq_len"] >= 1_000_000


def res(name):
    """A resource function: config resources (cpu, default or large per row)."""

    def pick(wildcards):
        if DEVICE == "cpu":
            entry = config["resources"]["cpu"]
        elif _is_large(getattr(wildcards, "shape", "")):
            entry = config["resources"]["large"]
        else:
            entry = config["resources"]["default"]
        return entry[name]

    return pick


# The job command: our package, from this checkout, with the Python that runs
# Snakemake. On a CPU-only run the Triton kernels execute in the interpreter,
# which must be switched on before triton is imported.
_env = f"PYTHONPATH={shlex.quote(str(BASEDIR))}${{PYTHONPATH:+:$PYTHONPATH}}"
if DEVICE == "cpu":
    _env += " TRITON_INTERPRET=1"
JOB = f"{_env} {shlex.quote(sys.executable)} -m shapewise job"


def per_shape_outputs(shape):
    return [
        f"results/preflight/{shape}.json",
        f"results/accuracy/{shape}.json",
        f"results/timing/{shape}.json",
        f"results/profile/{shape}/kernels.json",
        f"results/ablation/{shape}.json",
    ]
