# The report: summary, per-row tables, figures, environment, methods,
# limitations, an optional baseline comparison and a provenance appendix
# (also as provenance.json, which `shapewise verify results/report` re-checks).
#
# The report gets its inputs from the DAG, not by reading the manifests again:
# rule report_inputs writes one JSON file with the rows of this run (as
# common.smk loaded them, REPORT_INPUTS_TEXT), each row's result files
# (shapewise.inputs.paths), the fingerprints, the microbenchmark, the environment
# digest and the baseline. The file's name is the SHA-256 of its content, so a
# change of any of these is a new input file, which reruns the report; nothing
# is written while Snakemake builds the DAG. shapewise.report.report checks every
# result's identity against its row and refuses, by file name, one that does
# not match.
#
# The outputs are flagged update(): Snakemake neither deletes them before the
# report job runs nor after it fails, and the job itself renders into a
# temporary directory and moves the files into place only when all of it
# worked. A failing report job therefore leaves the previous report intact.


if config["baseline"] and not Path(config["baseline"], sw_paths.REPORT_FILES["summary"]).is_file():
    raise WorkflowError(
        f"config baseline={config['baseline']}: not a report directory (it holds no "
        f"{sw_paths.REPORT_FILES['summary']}); give a directory the report wrote, e.g. reports/h200"
    )


rule report_inputs:
    output:
        REPORT_INPUTS_FILE,
    log:
        sw_paths.log("report", "inputs"),
    localrule: True
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    params:
        text=verbatim(REPORT_INPUTS_TEXT),
    script:
        "../scripts/report_inputs.py"


rule report:
    input:
        **FINGERPRINTS,
        inputs=rules.report_inputs.output[0],
        microbench=sw_paths.MICROBENCH,
        per_shape=RESULT_TARGETS,
        candidates=CANDIDATE_TARGETS,
        manifests=MANIFESTS,
        config=[p for p in [sw_paths.CONFIG_FILE] if Path(p).is_file()],
        templates=sorted(os.path.relpath(p, BASEDIR) for p in (PACKAGE_SOURCE / "templates").glob("*.j2")),
        baseline=[f"{config['baseline']}/{sw_paths.REPORT_FILES['summary']}"] if config["baseline"] else [],
    output:
        **{key: update(f"{sw_paths.REPORT_DIR}/{name}") for key, name in sw_paths.REPORT_FILES.items()},
    log:
        sw_paths.log("report", "report"),
    threads: 1
    resources:
        mem_mb=4000,
        runtime=20,
    params:
        outdir=lambda wildcards, output: os.path.dirname(output.md),
    shell:
        "{REPORT} --inputs {input.inputs:q} --outdir {params.outdir:q} > {log} 2>&1"
