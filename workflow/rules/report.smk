# The report: summary, per-row tables, figures, environment, methods,
# limitations, an optional baseline comparison and a provenance appendix
# (also as provenance.json, which `shapewise verify results/report` re-checks).
#
# The report gets its inputs from the DAG, not by reading the manifests again:
# report_inputs() writes one JSON file with the rows of this run (as common.smk
# loaded them), each row's result files (shapewise.paths), the fingerprints, the
# microbenchmark, the environment digest and the baseline. The file's name is
# the SHA-256 of its content, so a change of any of these is a params change
# that reruns the report. shapewise.report checks every result's identity
# against its row and refuses, by file name, one that does not match.
#
# The outputs are flagged update(): Snakemake neither deletes them before the
# report job runs nor after it fails, and the job itself renders into a
# temporary directory and moves the files into place only when all of it
# worked. A failing report job therefore leaves the previous report intact.

import hashlib

from shapewise import paths as sw_paths

REPORT_DIR = "results/report"
REPORT_OUTPUTS = {name: f"{REPORT_DIR}/{name}" for name in
                  ("report.md", "report.html", "summary.csv", "provenance.json")}
# Every per-row result. Rule `all` must request these besides the report: Snakemake does not rerun the job of a
# missing intermediate file whose consumer (the report) is up to date, so a deleted result is only scheduled
# again when it is a target itself.
RESULT_TARGETS = [path for shape in SHAPES for path in per_shape_outputs(shape)]
BASELINE = config.get("baseline") or None
# The report command: our package from this checkout ({REPORT} is formatted by Snakemake, so the rule's shell
# command holds no absolute path).
REPORT = f"{_env} {shlex.quote(sys.executable)} -m shapewise.report"


def _pass_env_values():
    names = config.get("pass_env") or []
    if isinstance(names, str):
        names = names.split(",")
    return {name: os.environ[name] for name in names if name in os.environ}


def report_inputs(wildcards):
    """Write the report's inputs file (content-addressed, once) and return its path."""
    inputs = {
        "rows": [{"row": ROWS[shape], "results": sw_paths.per_shape(shape),
                  "profile_csv": sw_paths.profile_extra(shape)["csv"],
                  "profile_trace": sw_paths.profile_extra(shape)["trace"]} for shape in SHAPES],
        "manifests": MANIFESTS,
        "fingerprints": dict(FINGERPRINTS),
        "microbench": sw_paths.MICROBENCH,
        "environment_digest": ENV_DIGEST,
        "baseline": BASELINE,
        "commit": config.get("commit") or None,
        "pass_env": _pass_env_values(),
        "root": ".",
    }
    text = json.dumps(inputs, indent=1, sort_keys=True) + "\n"
    path = Path(sw_paths.RESULTS) / "report-inputs" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path.as_posix()


rule report:
    input:
        **FINGERPRINTS,
        microbench=sw_paths.MICROBENCH,
        per_shape=RESULT_TARGETS,
        manifests=MANIFESTS,
        config=[p for p in ["config/config.yaml"] if Path(p).is_file()],
        templates=sorted(os.path.relpath(p) for p in sw_paths.TEMPLATES.glob("*.j2")),
        baseline=[f"{BASELINE}/summary.csv"] if BASELINE else [],
    output:
        md=update(REPORT_OUTPUTS["report.md"]),
        html=update(REPORT_OUTPUTS["report.html"]),
        summary=update(REPORT_OUTPUTS["summary.csv"]),
        provenance=update(REPORT_OUTPUTS["provenance.json"]),
    params:
        inputs=report_inputs,
        outdir=REPORT_DIR,
    log:
        "results/logs/report/report.log",
    threads: 1
    resources:
        mem_mb=4000,
        runtime=20,
    shell:
        "{REPORT} --inputs {params.inputs:q} --outdir {params.outdir:q} > {log} 2>&1"
