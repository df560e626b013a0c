"""Where things are: the one owner of every path the pipeline, the CLI and the report use.

The package's own files (schemas/, templates/) are found at the top of the package (workflow/shapewise/), in a
checkout as in an installed wheel. Everything else is relative to the working directory: Snakemake's, the checkout's
root, where the pipeline runs (its config, manifests and results) and keeps its state under .snakemake/.
"""
from __future__ import annotations

from pathlib import Path

from shapewise.inputs import steps

PACKAGE = Path(__file__).resolve().parent.parent  # shapewise, above this subpackage (shapewise.inputs)
SCHEMAS = PACKAGE / "schemas"
SHAPES_SCHEMA = SCHEMAS / "shapes.schema.yaml"
CONFIG_SCHEMA = SCHEMAS / "config.schema.yaml"
TEMPLATES = PACKAGE / "templates"
# The run's directory: the working directory where shapewise is first imported (Snakemake's, and each job's),
# absolute so that a later change of directory moves none of the run's state.
ROOT = Path.cwd()
CONFIG_FILE = "config/config.yaml"  # the pipeline's config, relative to the root (Snakemake's working directory)

RESULTS = "results"
# The per-shape steps the report reads, in its order (shapewise.inputs.steps); each writes one JSON file per row.
SHAPE_STEPS = steps.of(steps.SHAPE, reported=True)
FINGERPRINTS = {"env": f"{RESULTS}/fingerprint/environment.json",
                "impl": f"{RESULTS}/fingerprint/implementation.json"}
MICROBENCH = f"{RESULTS}/microbench/microbench.json"
# The report of a run: its files (shapewise.report.report writes them, figures/ and data/ beside them) and the
# content-addressed inputs files its rule writes.
REPORT_DIR = f"{RESULTS}/report"
REPORT_FILES = {"md": "report.md", "html": "report.html", "summary": "summary.csv", "provenance": "provenance.json"}
REPORT_INPUTS = f"{RESULTS}/report-inputs"
# A row's warm-up (its kernels compiled before the jobs that time them): the per-shape step the report does not read.
(WARMUP_STEP,) = steps.of(steps.SHAPE, reported=False)
# Triton's on-disk cache of a run's compiled kernels, shared by its jobs, unless the user set TRITON_CACHE_DIR.
TRITON_CACHE = ROOT / ".snakemake" / "triton-cache"


def manifest(name: str) -> str:
    """The manifest file of a manifest name (`official` -> shapes/official.yaml), relative to the root."""
    return f"shapes/{name}.yaml"


OFFICIAL_MANIFEST = manifest("official")


def _result_under(base: str, step: str, shape: str) -> str:
    """The layout of per-shape results under `base` (results/, or a candidate's directory in it)."""
    if step == "profile":
        return f"{base}/profile/{shape}/kernels.json"
    return f"{base}/{step}/{shape}.json"


def _profile_extra_under(base: str, shape: str) -> dict:
    return {"csv": f"{base}/profile/{shape}/kernels.csv", "trace": f"{base}/profile/{shape}/trace.json"}


def result(step: str, shape: str) -> str:
    """The result JSON of one per-shape step (the profile step's table is its JSON), or of a row's warm-up."""
    if step not in SHAPE_STEPS and step != WARMUP_STEP:
        raise ValueError(f"unknown step {step!r}; steps are {SHAPE_STEPS + (WARMUP_STEP,)}")
    return _result_under(RESULTS, step, shape)


def profile_extra(shape: str) -> dict:
    """The profile step's other outputs: the per-kernel CSV and the Chrome trace."""
    return _profile_extra_under(RESULTS, shape)


def per_shape(shape: str) -> dict:
    """{step: result JSON} of one row."""
    return {step: result(step, shape) for step in SHAPE_STEPS}


# A report directory keeps a copy of every result it drew from under data/, laid out as under results/.
REPORT_DATA = "data"
REPORT_FIGURES = "figures"  # the report's figures (shapewise.report.report_figures)
# each measured candidate's files, candidates/<name>/<file> (shapewise.report.report_candidates)
REPORT_SOURCES = "candidates"
# The directories a report job fills. With REPORT_FILES they are what the job owns in a report directory: it
# replaces them whole, and provenance.json lists every file in them, since a file it left out could change unseen.
REPORT_DIRS = (REPORT_DATA, REPORT_FIGURES, REPORT_SOURCES)


def in_report(result_path: str) -> str:
    """Where a report directory keeps its copy of a result file (results/timing/a.json -> data/timing/a.json)."""
    prefix = f"{RESULTS}/"
    if not result_path.startswith(prefix):
        raise ValueError(f"not a result path under {prefix}: {result_path!r}")
    return f"{REPORT_DATA}/{result_path[len(prefix):]}"


def log(step: str, name: str) -> str:
    return f"{RESULTS}/logs/{step}/{name}.log"


# A candidate's results (config `candidates`, shapewise.candidates): per candidate and row, the accuracy, timing and
# profile steps (shapewise.inputs.steps: candidate-accuracy, ...), laid out under results/candidates/<name>/ as
# shapewise's are under results/.
CANDIDATE_STEPS = tuple(steps.result_name(step) for step in steps.of(steps.CANDIDATE))


def candidate_result(candidate: str, step: str, shape: str) -> str:
    if step not in CANDIDATE_STEPS:
        raise ValueError(f"unknown candidate step {step!r}; steps are {CANDIDATE_STEPS}")
    return _result_under(f"{RESULTS}/candidates/{candidate}", step, shape)


def candidate_profile_extra(candidate: str, shape: str) -> dict:
    return _profile_extra_under(f"{RESULTS}/candidates/{candidate}", shape)


def candidate_per_shape(candidate: str, shape: str) -> dict:
    """{step: result JSON} of one candidate on one row."""
    return {step: candidate_result(candidate, step, shape) for step in CANDIDATE_STEPS}


def candidate_log(candidate: str, step: str, shape: str) -> str:
    return f"{RESULTS}/logs/candidates/{candidate}/{step}/{shape}.log"
