# The measuring jobs. Every job writes its own files under results/<step>/,
# logs into results/logs/<step>/, and records the node and device it ran on.
# GPU jobs declare gpu=1: the run's gpu resource is the size of the local GPU
# pool (gpus.smk, unless --resources gpu=K), and each local GPU job locks one
# GPU of its own (shapewise.gpuslots); under SLURM each uses the GPU SLURM
# gives it. The environment fingerprint asks for gpu=1 (it records the GPU);
# the implementation fingerprint and the report ask for none. Result and log
# paths come from shapewise.paths; what the per-shape rules share (ROW_INPUTS,
# ROW_PARAMS, MEASURE_RESOURCES, job_shell) from common.smk.


rule fingerprint:
    output:
        f"{Path(sw_paths.FINGERPRINTS['env']).parent}/{{kind}}.json",
    log:
        sw_paths.log("fingerprint", "{kind}"),
    threads: 1
    resources:
        **LIGHT_RESOURCES,
        gpu=lambda wc: 1 if wc.kind == "environment" else 0,
    params:
        digest=lambda wc: DIGESTS[wc.kind],
    shell:
        "{JOB} fingerprint --kind {wildcards.kind} --device {DEVICE_ARG} "
        "--dag-digest {params.digest} --root {BASEDIR:q} --out {output} > {log} 2>&1"


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
    params:
        settings=device_settings("microbench"),
        harness=HARNESS_DIGEST,
        pass_env=PASS_ENV,
        device=DEVICE_ARG,
    shell:
        job_shell("microbench", "--settings {params.settings:q} --threads {threads}")


rule preflight:
    input:
        **FINGERPRINTS,
    output:
        sw_paths.result("preflight", "{shape}"),
    log:
        sw_paths.log("preflight", "{shape}"),
    priority: row_priority
    threads: 1
    resources:
        **LIGHT_RESOURCES,
        gpu=1,
    params:
        **ROW_PARAMS,
        headroom=config["preflight"]["headroom"],
    shell:
        job_shell("preflight", "--row {params.row:q} --headroom {params.headroom}")


rule accuracy:
    input:
        **ROW_INPUTS,
    output:
        sw_paths.result("accuracy", "{shape}"),
    log:
        sw_paths.log("accuracy", "{shape}"),
    priority: row_priority
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
    params:
        **ROW_PARAMS,
        chunked=CHUNKED_CHECK,
    shell:
        job_shell(
            "accuracy",
            "--row {params.row:q} --preflight {input.preflight} --chunked {params.chunked:q} --threads {threads}",
        )


rule timing:
    input:
        **ROW_INPUTS,
        microbench=checked(sw_paths.MICROBENCH),
    output:
        sw_paths.result("timing", "{shape}"),
    log:
        sw_paths.log("timing", "{shape}"),
    priority: row_priority
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
    params:
        **ROW_PARAMS,
        protocol=protocol_of("timing"),
    shell:
        job_shell(
            "timing",
            "--row {params.row:q} --preflight {input.preflight} --microbench {input.microbench} "
            "--protocol {params.protocol:q} --threads {threads}",
        )


rule profile:
    input:
        **ROW_INPUTS,
    output:
        **sw_paths.profile_extra("{shape}"),
        table=sw_paths.result("profile", "{shape}"),
    log:
        sw_paths.log("profile", "{shape}"),
    priority: row_priority
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
    params:
        **ROW_PARAMS,
        capture=protocol_of("profile"),
    shell:
        job_shell(
            "profile",
            "--row {params.row:q} --preflight {input.preflight} --capture {params.capture:q} "
            "--threads {threads} --csv {output.csv} --trace {output.trace}",
            out="{output.table}",
        )


rule ablation:
    input:
        **ROW_INPUTS,
    output:
        sw_paths.result("ablation", "{shape}"),
    log:
        sw_paths.log("ablation", "{shape}"),
    priority: row_priority
    threads: res("threads")
    resources:
        **MEASURE_RESOURCES,
    params:
        **ROW_PARAMS,
        protocol=protocol_of("ablation"),
        chunked=CHUNKED_CHECK,
    shell:
        job_shell(
            "ablation",
            "--row {params.row:q} --preflight {input.preflight} --protocol {params.protocol:q} "
            "--chunked {params.chunked:q} --threads {threads}",
        )
