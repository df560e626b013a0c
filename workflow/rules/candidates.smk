# Candidates (config `candidates`, docs/candidates.md): other implementations of the contract, each measured
# beside shapewise against the same reference. Per candidate and row: the accuracy, timing and profile jobs of
# shapewise.jobs.candidate, under results/candidates/<name>/. shapewise itself is always measured (measure.smk).
#
# What reruns a candidate's job: its own SHA-256 (shapewise.candidates.digest: every file of a package), its row,
# the reference's source files (shapewise.candidates.reference_files), the measuring code, the protocol, the time
# limit, pass_env, and the environment fingerprint. shapewise's own implementation does not: the implementation
# fingerprint is no input here, so editing shapewise, or one candidate, reruns no other candidate's jobs.

from shapewise import candidates as sw_candidates

try:
    CANDIDATES = sw_candidates.parse(config["candidates"], BASEDIR)
except sw_candidates.CandidateError as exc:
    raise WorkflowError(str(exc)) from None
CANDIDATE_DIGESTS = {name: sw_candidates.digest(path, BASEDIR) for name, path in CANDIDATES.items()}
# The candidate jobs' own code and the reference's: editing either reruns every candidate's jobs.
_CANDIDATE_HARNESS = (
    HARNESS_FILES
    + sorted((BASEDIR / "workflow" / "shapewise" / "jobs" / "candidate").glob("*.py"))
    + [BASEDIR / "workflow" / "shapewise" / "candidates.py"]
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


wildcard_constraints:
    candidate=sw_candidates.name_pattern().strip("^$"),


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


def candidate_shell(step, options, out="{output}"):
    return job_shell(
        f"candidate-{step}",
        "--row {params.row:q} --candidate {wildcards.candidate} --candidate-path {params.path:q} "
        f"--time-limit {{params.time_limit:q}} --threads {{threads}} {options}",
        out=out,
        impl="{params.digest}",
    )


rule candidate_accuracy:
    input:
        **CANDIDATE_INPUTS,
    output:
        sw_paths.candidate_result("{candidate}", "accuracy", "{shape}"),
    log:
        sw_paths.candidate_log("{candidate}", "accuracy", "{shape}"),
    priority: row_priority
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
    params:
        **CANDIDATE_PARAMS,
        headroom=config["preflight"]["headroom"],
        chunked=CHUNKED_CHECK,
    shell:
        candidate_shell("accuracy", "--headroom {params.headroom} --chunked {params.chunked:q}")


rule candidate_timing:
    input:
        **CANDIDATE_INPUTS,
    output:
        sw_paths.candidate_result("{candidate}", "timing", "{shape}"),
    log:
        sw_paths.candidate_log("{candidate}", "timing", "{shape}"),
    priority: row_priority
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
    params:
        **CANDIDATE_PARAMS,
        headroom=config["preflight"]["headroom"],
        protocol=protocol_of("timing"),
    shell:
        candidate_shell("timing", "--headroom {params.headroom} --protocol {params.protocol:q}")


rule candidate_profile:
    input:
        **CANDIDATE_INPUTS,
    output:
        **sw_paths.candidate_profile_extra("{candidate}", "{shape}"),
        table=sw_paths.candidate_result("{candidate}", "profile", "{shape}"),
    log:
        sw_paths.candidate_log("{candidate}", "profile", "{shape}"),
    priority: row_priority
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
    params:
        **CANDIDATE_PARAMS,
        capture=protocol_of("profile"),
    shell:
        candidate_shell(
            "profile", "--capture {params.capture:q} --csv {output.csv} --trace {output.trace}", out="{output.table}"
        )
