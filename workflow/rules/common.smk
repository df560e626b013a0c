# Parse-time helpers: device choice, manifest loading and validation, the
# digests that decide what reruns, the SHAPEWISE_* variables passed to the
# jobs, the parts every measuring rule shares, and the report's inputs.
#
# Nothing here may depend on where the checkout lies: a params value, an input
# path or a rule's shell command (before formatting) that held an absolute
# path would rerun every job of a checkout moved or copied elsewhere.
#
# Nothing here imports torch (it would cost seconds on every `snakemake` call).

import hashlib
import json
import math
import os
import shlex
import sys
from pathlib import Path

from shapewise import candidates as sw_candidates
from shapewise.execution import gpuslots as sw_gpuslots
from shapewise.inputs import manifest as sw_manifest
from shapewise.inputs import paths as sw_paths
from shapewise.inputs import settings as sw_settings
from shapewise.inputs import steps as sw_steps
from shapewise.provenance import inventory as sw_inventory
from shapewise.provenance import provenance as sw_provenance

BASEDIR = Path(workflow.basedir).resolve()
# The package's source in this checkout: the digests below hash it, the jobs run the installed package.
PACKAGE_SOURCE = BASEDIR / "workflow" / "shapewise"
if sw_paths.PACKAGE != PACKAGE_SOURCE:
    print(
        f"note: the jobs run shapewise installed from {sw_paths.PACKAGE}, not from this checkout "
        "(`python3 -m pip install -e .` here installs this one)",
        file=sys.stderr,
    )


wildcard_constraints:
    shape="[A-Za-z0-9][A-Za-z0-9_-]*",
    kind="environment|implementation",
    candidate=sw_candidates.name_body(),


# DEVICE_ARG is what the jobs get: cuda or cpu when the user says so
# (SHAPEWISE_DEVICE or config `device`), else auto, which each job resolves on
# the node it runs on (torch.cuda.is_available()). This keeps every job's
# command line and params the same whether Snakemake parses this file on a
# GPU node or on a cluster's login node. DEVICE (this machine's guess) only
# picks the default manifests.
DEVICE_ARG = os.environ.get("SHAPEWISE_DEVICE") or config["device"]
_DEVICES = sw_settings.devices()
if DEVICE_ARG not in _DEVICES:
    raise WorkflowError(
        f"SHAPEWISE_DEVICE / config device must be {', '.join(_DEVICES[:-1])} or {_DEVICES[-1]}, got {DEVICE_ARG!r}"
    )
# A real GPU, as `nvidia-smi -L` lists it: the fake GPU pool of tests (an empty environ here) picks no manifests.
DEVICE = DEVICE_ARG if DEVICE_ARG != "auto" else ("cuda" if sw_gpuslots.list_gpus(environ={}) else "cpu")


def _manifest_names():
    chosen = config["shapes"]
    if chosen == "auto":
        return ["official", "contract"] if DEVICE == "cuda" else ["smoke"]
    if isinstance(chosen, str):
        return [name for name in chosen.split(",") if name]
    return list(chosen)


MANIFESTS = [sw_paths.manifest(name) for name in _manifest_names()]
# The report records every input by its path under the checkout (shapewise.provenance.provenance): a manifest or config
# file that it could not record (one linked from outside the checkout) stops the run now, not in its report job.
_UNRECORDABLE = sw_provenance.unrecordable(".", inputs=[*MANIFESTS, sw_paths.CONFIG_FILE])
if _UNRECORDABLE:
    raise WorkflowError("\n".join(_UNRECORDABLE + ["nothing was run: keep the file itself under the checkout"]))
# The bytes the rows are read from: the report refuses to pair results with a manifest edited since.
MANIFEST_SHA256 = {m: sw_inventory.sha256_file(m) for m in MANIFESTS if Path(m).is_file()}
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
HARNESS_FILES = sorted((PACKAGE_SOURCE / "jobs").glob("*.py")) + [PACKAGE_SOURCE / "analysis" / "roofline.py"]
HARNESS_DIGEST = sw_inventory.digest_of({p.name: sw_inventory.sha256_file(p) for p in HARNESS_FILES if p.is_file()})

FINGERPRINTS = dict(sw_paths.FINGERPRINTS)

# SHAPEWISE_* variables of this shell that the jobs keep (config pass_env);
# shapewise.cli removes every other one inside the job. Each is passed as
# `--env NAME=VALUE`, and the whole string is a params value of every
# measuring job, so setting, changing or unsetting one reruns them; the
# report records the same values.
PASSED_ENV = sw_settings.pass_env(config["pass_env"])


def verbatim(text):
    """A params value that Snakemake keeps as it is: a string value is formatted with the job's wildcards, so a
    `{name}` in text a user wrote (a passed variable's value, a candidate's path) would be read as one."""
    return lambda wildcards: text


PASS_ENV = verbatim(" ".join(f"--env {shlex.quote(f'{name}={value}')}" for name, value in PASSED_ENV.items()))


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
    from shapewise.analysis import roofline

    row = ROWS.get(shape)
    return row is not None and roofline.flops(**row)["total"] >= config["heavy"]["min_gflop"] * 1e9


def is_heavy_row(wildcards):
    """Whether the job's row is heavy (config `heavy`), as a function of its wildcards."""
    return _is_heavy(wildcards.shape)


def row_priority(wildcards):
    """Cheaper rows first (higher priority runs first): a run stopped early (a time limit, a GPU gone) has
    finished the most rows it could. Priority = -log2(FLOPs of one forward)."""
    from shapewise.analysis import roofline

    row = ROWS.get(wildcards.shape)
    return -math.log2(max(2.0, roofline.flops(**row)["total"])) if row is not None else 0


# With heavy.shared_first, a heavy row's jobs that time nothing start before any other row's job: row 14's
# warm-up, accuracy and profile, the run's longest chain of shared jobs, then share the GPU with the other rows'
# shared jobs from the start, instead of holding it alone at the end. Snakemake starts the ready jobs whose
# priorities sum highest, so this is above the sum of all the jobs that could start in its place.
HEAVY_SHARED_FIRST = 10**6


def step_priority(step):
    """The priority function of `step`'s jobs: the step's order (shapewise.inputs.steps says why) first, then the row's
    (the cheapest first, or the costliest where the step says so; heavy.shared_first: a heavy row's shared steps
    first)."""
    order = sw_steps.STEPS[step].order

    def priority(wildcards):
        shared = sw_steps.STEPS[step].gpu == sw_steps.SHARED
        first = config["heavy"]["shared_first"] and shared and _is_heavy(wildcards.shape)
        row = -row_priority(wildcards) if sw_steps.STEPS[step].costliest_first else row_priority(wildcards)
        return order * 1000 + row + (HEAVY_SHARED_FIRST if first else 0)

    return priority


def res(name):
    """A resource function: config resources.default, or heavy.resources for a heavy row."""

    def pick(wildcards):
        if _is_heavy(getattr(wildcards, "shape", "")):
            return config["heavy"]["resources"][name]
        return config["resources"]["default"][name]

    return pick


# The job commands: the installed package, with the Python that runs Snakemake
# (so the one that imported shapewise above). A job that resolves to the CPU switches on TRITON_INTERPRET=1
# itself (shapewise.cli) before anything imports triton.
#
# Lints that stay (.ci/lint.py accepts exactly these):
# - The shell commands name JOB, REPORT, BASEDIR, IMPL_DIGEST and ENV_DIGEST
#   as globals rather than params, because params are a rerun trigger and none
#   of these may be one: JOB, REPORT and BASEDIR hold absolute paths (a copied
#   checkout would rerun everything); the digests already rerun each job
#   through the fingerprint files it takes as input (the microbenchmark, which
#   measures the machine, takes only the environment's). The device choice is
#   a param: results of another device are never reused.
# - The rules name no conda environment or container, because every job runs
#   this Python, whose packages the environment fingerprint records, and
#   another software stack would measure something other than what it says.
JOB = f"{shlex.quote(sys.executable)} -m shapewise job"
REPORT = f"{shlex.quote(sys.executable)} -m shapewise.report.report"


def job_shell(step):
    """The shell command of a job of `step`, from its options in shapewise.inputs.steps: every job but the fingerprints
    gets the device, the implementation and environment digests (recorded in its result's identity; a candidate's
    job gets its candidate's), the variables of config pass_env, its result file and its log."""
    return sw_steps.shell(step)


# The parts the measuring rules share: both fingerprints and the row's
# preflight result as inputs (every per-shape job after preflight); the row,
# the measuring code's digest and the passed variables as params (each a
# rerun trigger); the row's memory and time (res; the microbenchmark, of no
# row, gets resources.default), each rule adding its GPU (gpu_resources,
# gpus.smk).
def checked(pattern):
    """An input function for a result that a job reads: the path, after a check that an existing file is a readable
    result (shapewise.provenance.provenance.result_file_problem). Input functions run while the DAG is built, before
    Snakemake deletes any output it would regenerate, so a damaged preflight stops the run before the good results of
    its row are removed."""

    def path(wildcards):
        name = pattern.format(**dict(wildcards.items()))
        problem = sw_provenance.result_file_problem(name) if Path(name).exists() else None
        if problem:
            raise WorkflowError(f"{name} {problem}; nothing was run: remove it (rm {name}) and run again")
        return name

    return path


ROW_INPUTS = {**FINGERPRINTS, "preflight": checked(sw_paths.result("preflight", "{shape}"))}
ROW_PARAMS = {"row": row_param, "harness": HARNESS_DIGEST, "pass_env": PASS_ENV, "device": DEVICE_ARG}
MEASURE_RESOURCES = {"mem_mb": res("mem_mb"), "runtime": res("runtime")}
# What the light jobs (fingerprints, preflight) ask for, whatever the row.
LIGHT_RESOURCES = {"mem_mb": 2000, "runtime": 10}
CHUNKED_CHECK = json.dumps(config["chunked_check"], sort_keys=True)


def per_shape_outputs(shape):
    return list(sw_paths.per_shape(shape).values())


# Every per-row result. Rule `all` must request these besides the report: Snakemake does not rerun the job of a
# missing intermediate file whose consumer (the report) is up to date, so a deleted result is only scheduled
# again when it is a target itself.
RESULT_TARGETS = [path for shape in SHAPES for path in per_shape_outputs(shape)]


# Candidates (config `candidates`; their rules: candidates.smk, which says what reruns their jobs).
try:
    CANDIDATES = sw_candidates.parse(config["candidates"], BASEDIR)
except sw_candidates.CandidateError as exc:
    raise WorkflowError(str(exc)) from None
CANDIDATE_DIGESTS = {name: sw_candidates.digest(path, BASEDIR) for name, path in CANDIDATES.items()}
# Each candidate's path (recorded in the report's provenance.json) and its files' copies in the report, checked as
# the report job would check them, before any job.
_UNRECORDABLE = [
    f"config candidates: {name}={path!r}: the path holds a control character (a line break or an escape)"
    for name, path in CANDIDATES.items()
    if sw_provenance.has_control_character(path)
] or sw_provenance.unrecordable(
    ".",
    artifacts=[
        f"{sw_paths.REPORT_SOURCES}/{name}/{rel}"
        for name, path in CANDIDATES.items()
        for rel in sw_candidates.files(path, BASEDIR)
    ],
)
if _UNRECORDABLE:
    raise WorkflowError("\n".join(_UNRECORDABLE + ["nothing was run: rename the candidate's files"]))
# The candidate jobs' own code and the reference's: editing either reruns every candidate's jobs.
_CANDIDATE_HARNESS = (
    HARNESS_FILES
    + sorted((PACKAGE_SOURCE / "jobs" / "candidate").glob("*.py"))
    + [PACKAGE_SOURCE / "candidates.py"]
    + sw_candidates.reference_files(BASEDIR)
)
CANDIDATE_HARNESS_DIGEST = sw_inventory.digest_of(
    {p.relative_to(BASEDIR).as_posix(): sw_inventory.sha256_file(p) for p in _CANDIDATE_HARNESS}
)


def _check_time_limits():
    """Each time limit below the runtime resource of the jobs it stops: SLURM would end such a job first, before
    it could record the candidate's timeout."""
    default, heavy = config["resources"]["default"]["runtime"], config["heavy"]["resources"]["runtime"]
    for name, seconds, runtime_name, minutes in (
        ("candidate_time_limit_s.cuda", config["candidate_time_limit_s"]["cuda"], "resources.default", default),
        ("candidate_time_limit_s.cpu", config["candidate_time_limit_s"]["cpu"], "resources.default", default),
        ("heavy.candidate_time_limit_s", config["heavy"]["candidate_time_limit_s"], "heavy.resources", heavy),
    ):
        if seconds >= minutes * 60:
            raise WorkflowError(
                f"config {name} = {seconds} s is not below {runtime_name}.runtime = {minutes} min: the job would "
                "be ended before it could record the candidate's timeout"
            )


_check_time_limits()


def candidate_outputs(name, shape):
    return [
        *sw_paths.candidate_per_shape(name, shape).values(),
        *sw_paths.candidate_profile_extra(name, shape).values(),
    ]


# Every candidate's result of every row, requested by rule `all` and the report (as RESULT_TARGETS are).
CANDIDATE_TARGETS = [path for name in CANDIDATES for shape in SHAPES for path in candidate_outputs(name, shape)]


def candidate_path(wildcards):
    if wildcards.candidate not in CANDIDATES:
        raise WorkflowError(
            f"candidate {wildcards.candidate!r} is not in config candidates ({', '.join(CANDIDATES) or 'none'})"
        )
    return CANDIDATES[wildcards.candidate]


# What the candidate rules share: the environment fingerprint as input; the row, the candidate's path and digest,
# its time limit, the candidate jobs' code and the passed variables as params (each a rerun trigger).
CANDIDATE_INPUTS = {"env": FINGERPRINTS["env"]}
CANDIDATE_PARAMS = {
    **ROW_PARAMS,
    "harness": CANDIDATE_HARNESS_DIGEST,
    "path": candidate_path,
    "digest": lambda wildcards: CANDIDATE_DIGESTS[wildcards.candidate],
    "time_limit": protocol_of("candidate_time_limit_s"),
}


def _report_inputs():
    """The report's inputs as the text of a JSON file (report.smk says why): what this parse loaded."""
    inputs = {
        "rows": [
            {
                "row": ROWS[shape],
                "results": sw_paths.per_shape(shape),
                "profile_csv": sw_paths.profile_extra(shape)["csv"],
                "profile_trace": sw_paths.profile_extra(shape)["trace"],
                # each candidate's results of the row
                "candidates": {
                    name: {
                        "results": sw_paths.candidate_per_shape(name, shape),
                        "profile_csv": sw_paths.candidate_profile_extra(name, shape)["csv"],
                    }
                    for name in CANDIDATES
                },
            }
            for shape in SHAPES
        ],
        "candidates": [
            {"name": name, "path": path, "sha256": CANDIDATE_DIGESTS[name]} for name, path in CANDIDATES.items()
        ],
        "manifests": MANIFESTS,
        "manifest_sha256": MANIFEST_SHA256,
        "device": DEVICE_ARG,
        "fingerprints": dict(FINGERPRINTS),
        "microbench": sw_paths.MICROBENCH,
        "environment_digest": ENV_DIGEST,
        "baseline": config["baseline"],
        "commit": config["commit"],
        "pass_env": PASSED_ENV,
        "root": ".",
    }
    return json.dumps(inputs, indent=1, sort_keys=True) + "\n"


# Rule report_inputs (report.smk) writes this text into a file named by its digest: any change of it is a new
# file, which reruns the report.
REPORT_INPUTS_TEXT = _report_inputs()
_REPORT_INPUTS_NAME = hashlib.sha256(REPORT_INPUTS_TEXT.encode()).hexdigest()[:16]
REPORT_INPUTS_FILE = f"{sw_paths.REPORT_INPUTS}/{_REPORT_INPUTS_NAME}.json"


# Every row's warm-up: targets of rule `all`, not inputs of the report (a warm-up that fails holds up no report).
WARMUP_TARGETS = [sw_paths.result(sw_paths.WARMUP_STEP, shape) for shape in SHAPES]
