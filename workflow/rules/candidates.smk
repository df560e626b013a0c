# Candidates (config `candidates`, docs/candidates.md): other implementations of the contract, each measured
# beside shapewise against the same reference. Per candidate and row: the accuracy, timing and profile jobs of
# shapewise.jobs.candidate, under results/candidates/<name>/. shapewise itself is always measured (measure.smk).
#
# What reruns a candidate's job: its own SHA-256 (shapewise.candidates.digest: every file of a package), its row,
# the reference's source files (shapewise.candidates.reference_files), the measuring code, the protocol, the time
# limit, pass_env, and the environment fingerprint. shapewise's own implementation does not: the implementation
# fingerprint is no input here, so editing shapewise, or one candidate, reruns no other candidate's jobs.
#
# Their parse-time part (the names, paths and digests, the time limits' check, what the rules share) is in
# common.smk.


rule candidate_accuracy:
    input:
        **CANDIDATE_INPUTS,
    output:
        sw_paths.candidate_result("{candidate}", "accuracy", "{shape}"),
    log:
        sw_paths.candidate_log("{candidate}", "accuracy", "{shape}"),
    priority: step_priority("candidate-accuracy")
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
        **gpu_resources("candidate-accuracy"),
    params:
        **CANDIDATE_PARAMS,
        headroom=config["preflight"]["headroom"],
        chunked=CHUNKED_CHECK,
    shell:
        job_shell("candidate-accuracy")


rule candidate_timing:
    input:
        **CANDIDATE_INPUTS,
    output:
        sw_paths.candidate_result("{candidate}", "timing", "{shape}"),
    log:
        sw_paths.candidate_log("{candidate}", "timing", "{shape}"),
    priority: step_priority("candidate-timing")
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
        **gpu_resources("candidate-timing"),
    params:
        **CANDIDATE_PARAMS,
        headroom=config["preflight"]["headroom"],
        protocol=protocol_of("timing"),
    shell:
        job_shell("candidate-timing")


rule candidate_profile:
    input:
        **CANDIDATE_INPUTS,
    output:
        **sw_paths.candidate_profile_extra("{candidate}", "{shape}"),
        table=sw_paths.candidate_result("{candidate}", "profile", "{shape}"),
    log:
        sw_paths.candidate_log("{candidate}", "profile", "{shape}"),
    priority: step_priority("candidate-profile")
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
        **gpu_resources("candidate-profile"),
    params:
        **CANDIDATE_PARAMS,
        capture=protocol_of("profile"),
    shell:
        job_shell("candidate-profile")
