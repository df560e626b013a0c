# The report: summary, per-shape table, figures, environment, methods,
# limitations and a provenance appendix (also as provenance.json, which
# `shapewise verify results/report` re-checks).


rule report:
    input:
        **FINGERPRINTS,
        microbench="results/microbench/microbench.json",
        per_shape=[path for shape in SHAPES for path in per_shape_outputs(shape)],
        manifests=MANIFESTS,
        config=[p for p in ["config/config.yaml"] if Path(p).is_file()],
        templates=sorted(str(p) for p in Path("reports/templates").glob("*.j2")),
    output:
        md="results/report/report.md",
        html="results/report/report.html",
        summary="results/report/summary.csv",
        provenance="results/report/provenance.json",
    params:
        shapes=",".join(SHAPES),
        manifests=",".join(MANIFESTS),
    log:
        "results/logs/report/report.log",
    threads: 1
    resources:
        mem_mb=4000,
        runtime=20,
    shell:
        "{JOB} report --shapes {params.shapes} --manifests {params.manifests} "
        "--outdir results/report > {log} 2>&1"
