# The measuring jobs. Every job writes its own files under results/<step>/,
# logs into results/logs/<step>/, and records the node and device it ran on.
# GPU jobs ask for their GPU through gpu_resources (gpus.smk): a job that times
# (microbench, timing, ablation) holds a GPU alone, the others (the environment
# fingerprint, preflight, warm-up, accuracy, profile) may share one
# (shapewise.execution.gpuslots); under SLURM each uses the GPU SLURM gives it. The
# implementation fingerprint and the report ask for none. Jobs start in
# step_priority order (common.smk). Each rule names its step of
# shapewise.inputs.steps, whose options (and the rule's params, inputs and outputs
# they name) make its shell command (job_shell); result and log paths come
# from shapewise.inputs.paths; what the per-shape rules share (ROW_INPUTS,
# ROW_PARAMS, MEASURE_RESOURCES) from common.smk.


rule fingerprint:
    output:
        f"{Path(sw_paths.FINGERPRINTS['env']).parent}/{{kind}}.json",
    log:
        sw_paths.log("fingerprint", "{kind}"),
    threads: 1
    resources:
        **LIGHT_RESOURCES,
        **gpu_resources("fingerprint", uses_gpu=lambda wc: wc.kind == "environment"),
    params:
        digest=lambda wc: DIGESTS[wc.kind],
    shell:
        job_shell("fingerprint")


rule microbench:
    input:
        env=FINGERPRINTS["env"],
    output:
        sw_paths.MICROBENCH,
    log:
        sw_paths.log("microbench", "microbench"),
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
        **gpu_resources("microbench"),
    params:
        settings=device_settings("microbench"),
        harness=HARNESS_DIGEST,
        pass_env=PASS_ENV,
        device=DEVICE_ARG,
    shell:
        job_shell("microbench")


rule preflight:
    input:
        **FINGERPRINTS,
    output:
        sw_paths.result("preflight", "{shape}"),
    log:
        sw_paths.log("preflight", "{shape}"),
    priority: step_priority("preflight")
    threads: 1
    resources:
        **LIGHT_RESOURCES,
        **gpu_resources("preflight"),
    params:
        **ROW_PARAMS,
        headroom=config["preflight"]["headroom"],
        chunked=CHUNKED_CHECK,
    shell:
        job_shell("preflight")


rule warmup:
    input:
        **ROW_INPUTS,
    output:
        sw_paths.result(sw_paths.WARMUP_STEP, "{shape}"),
    log:
        sw_paths.log(sw_paths.WARMUP_STEP, "{shape}"),
    priority: step_priority("warmup")
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
        **gpu_resources("warmup"),
    params:
        **ROW_PARAMS,
        protocol=protocol_of("ablation"),
    shell:
        job_shell("warmup")


rule accuracy:
    input:
        **ROW_INPUTS,
    output:
        sw_paths.result("accuracy", "{shape}"),
    log:
        sw_paths.log("accuracy", "{shape}"),
    priority: step_priority("accuracy")
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
        **gpu_resources("accuracy"),
    params:
        **ROW_PARAMS,
        chunked=CHUNKED_CHECK,
    shell:
        job_shell("accuracy")


rule timing:
    input:
        **ROW_INPUTS,
        microbench=checked(sw_paths.MICROBENCH),
    output:
        sw_paths.result("timing", "{shape}"),
    log:
        sw_paths.log("timing", "{shape}"),
    priority: step_priority("timing")
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
        **gpu_resources("timing", heavy=is_heavy_row),
    params:
        **ROW_PARAMS,
        protocol=protocol_of("timing"),
    shell:
        job_shell("timing")


rule profile:
    input:
        **ROW_INPUTS,
    output:
        **sw_paths.profile_extra("{shape}"),
        table=sw_paths.result("profile", "{shape}"),
    log:
        sw_paths.log("profile", "{shape}"),
    priority: step_priority("profile")
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
        **gpu_resources("profile"),
    params:
        **ROW_PARAMS,
        capture=protocol_of("profile"),
    shell:
        job_shell("profile")


rule ablation:
    input:
        **ROW_INPUTS,
    output:
        sw_paths.result("ablation", "{shape}"),
    log:
        sw_paths.log("ablation", "{shape}"),
    priority: step_priority("ablation")
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
        **gpu_resources("ablation", heavy=is_heavy_row),
    params:
        **ROW_PARAMS,
        protocol=protocol_of("ablation"),
        chunked=CHUNKED_CHECK,
    shell:
        job_shell("ablation")
