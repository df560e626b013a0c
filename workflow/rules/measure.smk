# The measuring jobs. Every job writes its own files under results/<step>/,
# logs into results/logs/<step>/, and records the node and device it ran on.
# GPU jobs declare gpu=1: the run's gpu resource is the size of the local GPU
# pool (gpus.smk, unless --resources gpu=K), and each local GPU job locks one
# GPU of its own (shapewise.gpuslots); under SLURM each uses the GPU SLURM
# gives it. The environment fingerprint asks for gpu=1 (it records the GPU);
# the implementation fingerprint and the report ask for none. Result and log
# paths come from shapewise.paths.
#
# Every measuring job gets the implementation and environment digests (it
# records them in its result's identity) and the SHAPEWISE_* variables of
# config pass_env (params.pass_env: a change reruns the job).


rule fingerprint:
    output:
        f"{Path(sw_paths.FINGERPRINTS['env']).parent}/{{kind}}.json",
    params:
        digest=lambda wc: DIGESTS[wc.kind],
    log:
        sw_paths.log("fingerprint", "{kind}"),
    threads: 1
    resources:
        gpu=lambda wc: 1 if wc.kind == "environment" else 0,
        mem_mb=2000,
        runtime=10,
    shell:
        "{JOB} fingerprint --kind {wildcards.kind} --device {DEVICE_ARG} "
        "--dag-digest {params.digest} --root {BASEDIR:q} --out {output} > {log} 2>&1"


rule microbench:
    input:
        env=FINGERPRINTS["env"],
    output:
        sw_paths.MICROBENCH,
    params:
        settings=device_settings("microbench"),
        harness=HARNESS_DIGEST,
        pass_env=PASS_ENV,
    log:
        sw_paths.log("microbench", "microbench"),
    threads: res("threads")
    resources:
        gpu=1,
        mem_mb=res("mem_mb"),
        runtime=res("runtime"),
    shell:
        "{JOB} microbench --device {DEVICE_ARG} --settings {params.settings:q} "
        "--threads {threads} --impl-digest {IMPL_DIGEST} --env-digest {ENV_DIGEST} {params.pass_env} "
        "--out {output} > {log} 2>&1"


rule preflight:
    input:
        **FINGERPRINTS,
    output:
        sw_paths.result("preflight", "{shape}"),
    params:
        row=row_param,
        headroom=config["preflight"]["headroom"],
        harness=HARNESS_DIGEST,
        pass_env=PASS_ENV,
    priority: row_priority
    log:
        sw_paths.log("preflight", "{shape}"),
    threads: 1
    resources:
        gpu=1,
        mem_mb=2000,
        runtime=10,
    shell:
        "{JOB} preflight --device {DEVICE_ARG} --row {params.row:q} --headroom {params.headroom} "
        "--impl-digest {IMPL_DIGEST} --env-digest {ENV_DIGEST} {params.pass_env} --out {output} > {log} 2>&1"


rule accuracy:
    input:
        **FINGERPRINTS,
        preflight=sw_paths.result("preflight", "{shape}"),
    output:
        sw_paths.result("accuracy", "{shape}"),
    params:
        row=row_param,
        chunked=json.dumps(config["chunked_check"], sort_keys=True),
        harness=HARNESS_DIGEST,
        pass_env=PASS_ENV,
    priority: row_priority
    log:
        sw_paths.log("accuracy", "{shape}"),
    threads: res("threads")
    resources:
        gpu=1,
        mem_mb=res("mem_mb"),
        runtime=res("runtime"),
    shell:
        "{JOB} accuracy --device {DEVICE_ARG} --row {params.row:q} --preflight {input.preflight} "
        "--chunked {params.chunked:q} --threads {threads} "
        "--impl-digest {IMPL_DIGEST} --env-digest {ENV_DIGEST} {params.pass_env} --out {output} > {log} 2>&1"


rule timing:
    input:
        **FINGERPRINTS,
        preflight=sw_paths.result("preflight", "{shape}"),
        microbench=sw_paths.MICROBENCH,
    output:
        sw_paths.result("timing", "{shape}"),
    params:
        row=row_param,
        protocol=protocol_of("timing"),
        harness=HARNESS_DIGEST,
        pass_env=PASS_ENV,
    priority: row_priority
    log:
        sw_paths.log("timing", "{shape}"),
    threads: res("threads")
    resources:
        gpu=1,
        mem_mb=res("mem_mb"),
        runtime=res("runtime"),
    shell:
        "{JOB} timing --device {DEVICE_ARG} --row {params.row:q} --preflight {input.preflight} "
        "--microbench {input.microbench} --protocol {params.protocol:q} --threads {threads} "
        "--impl-digest {IMPL_DIGEST} --env-digest {ENV_DIGEST} {params.pass_env} --out {output} > {log} 2>&1"


rule profile:
    input:
        **FINGERPRINTS,
        preflight=sw_paths.result("preflight", "{shape}"),
    output:
        table=sw_paths.result("profile", "{shape}"),
        **sw_paths.profile_extra("{shape}"),
    params:
        row=row_param,
        capture=protocol_of("profile"),
        harness=HARNESS_DIGEST,
        pass_env=PASS_ENV,
    priority: row_priority
    log:
        sw_paths.log("profile", "{shape}"),
    threads: res("threads")
    resources:
        gpu=1,
        mem_mb=res("mem_mb"),
        runtime=res("runtime"),
    shell:
        "{JOB} profile --device {DEVICE_ARG} --row {params.row:q} --preflight {input.preflight} "
        "--capture {params.capture:q} --threads {threads} --out {output.table} --csv {output.csv} "
        "--trace {output.trace} --impl-digest {IMPL_DIGEST} --env-digest {ENV_DIGEST} {params.pass_env} "
        "> {log} 2>&1"


rule ablation:
    input:
        **FINGERPRINTS,
        preflight=sw_paths.result("preflight", "{shape}"),
    output:
        sw_paths.result("ablation", "{shape}"),
    params:
        row=row_param,
        protocol=protocol_of("ablation"),
        chunked=json.dumps(config["chunked_check"], sort_keys=True),
        harness=HARNESS_DIGEST,
        pass_env=PASS_ENV,
    priority: row_priority
    log:
        sw_paths.log("ablation", "{shape}"),
    threads: res("threads")
    resources:
        gpu=1,
        mem_mb=res("mem_mb"),
        runtime=res("runtime"),
    shell:
        "{JOB} ablation --device {DEVICE_ARG} --row {params.row:q} --preflight {input.preflight} "
        "--protocol {params.protocol:q} --chunked {params.chunked:q} --threads {threads} "
        "--impl-digest {IMPL_DIGEST} --env-digest {ENV_DIGEST} {params.pass_env} --out {output} > {log} 2>&1"
