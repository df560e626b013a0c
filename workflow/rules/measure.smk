# The measuring jobs. Every job writes its own files under results/<step>/,
# logs into results/logs/<step>/, and records the node and device it ran on.
# GPU jobs declare gpu=1 so that the default profile (gpu=1 in total) never
# lets two of them share a GPU.


rule fingerprint:
    output:
        "results/fingerprint/{kind}.json",
    params:
        digest=lambda wc: DIGESTS[wc.kind],
        root=str(BASEDIR),
    log:
        "results/logs/fingerprint/{kind}.log",
    threads: 1
    resources:
        gpu=lambda wc: 1 if wc.kind == "environment" else 0,
        mem_mb=2000,
        runtime=10,
    shell:
        "{JOB} fingerprint --kind {wildcards.kind} --device {DEVICE_ARG} "
        "--dag-digest {params.digest} --root {params.root:q} --out {output} > {log} 2>&1"


rule microbench:
    input:
        env=FINGERPRINTS["env"],
    output:
        "results/microbench/microbench.json",
    params:
        settings=device_settings("microbench"),
        harness=HARNESS_DIGEST,
    log:
        "results/logs/microbench/microbench.log",
    threads: res("threads")
    resources:
        gpu=1,
        mem_mb=res("mem_mb"),
        runtime=res("runtime"),
    shell:
        "{JOB} microbench --device {DEVICE_ARG} --settings {params.settings:q} "
        "--threads {threads} --out {output} > {log} 2>&1"


rule preflight:
    input:
        **FINGERPRINTS,
    output:
        "results/preflight/{shape}.json",
    params:
        row=row_param,
        headroom=config["preflight"]["headroom"],
        harness=HARNESS_DIGEST,
    priority: row_priority
    log:
        "results/logs/preflight/{shape}.log",
    threads: 1
    resources:
        gpu=1,
        mem_mb=2000,
        runtime=10,
    shell:
        "{JOB} preflight --device {DEVICE_ARG} --row {params.row:q} --headroom {params.headroom} "
        "--out {output} > {log} 2>&1"


rule accuracy:
    input:
        **FINGERPRINTS,
        preflight="results/preflight/{shape}.json",
    output:
        "results/accuracy/{shape}.json",
    params:
        row=row_param,
        chunked=json.dumps(config["chunked_check"], sort_keys=True),
        harness=HARNESS_DIGEST,
    priority: row_priority
    log:
        "results/logs/accuracy/{shape}.log",
    threads: res("threads")
    resources:
        gpu=1,
        mem_mb=res("mem_mb"),
        runtime=res("runtime"),
    shell:
        "{JOB} accuracy --device {DEVICE_ARG} --row {params.row:q} --preflight {input.preflight} "
        "--chunked {params.chunked:q} --threads {threads} --out {output} > {log} 2>&1"


rule timing:
    input:
        **FINGERPRINTS,
        preflight="results/preflight/{shape}.json",
        microbench="results/microbench/microbench.json",
    output:
        "results/timing/{shape}.json",
    params:
        row=row_param,
        protocol=protocol_of("timing"),
        harness=HARNESS_DIGEST,
    priority: row_priority
    log:
        "results/logs/timing/{shape}.log",
    threads: res("threads")
    resources:
        gpu=1,
        mem_mb=res("mem_mb"),
        runtime=res("runtime"),
    shell:
        "{JOB} timing --device {DEVICE_ARG} --row {params.row:q} --preflight {input.preflight} "
        "--microbench {input.microbench} --protocol {params.protocol:q} --threads {threads} "
        "--out {output} > {log} 2>&1"


rule profile:
    input:
        **FINGERPRINTS,
        preflight="results/preflight/{shape}.json",
    output:
        table="results/profile/{shape}/kernels.json",
        csv="results/profile/{shape}/kernels.csv",
        trace="results/profile/{shape}/trace.json",
    params:
        row=row_param,
        capture=protocol_of("profile"),
        harness=HARNESS_DIGEST,
    priority: row_priority
    log:
        "results/logs/profile/{shape}.log",
    threads: res("threads")
    resources:
        gpu=1,
        mem_mb=res("mem_mb"),
        runtime=res("runtime"),
    shell:
        "{JOB} profile --device {DEVICE_ARG} --row {params.row:q} --preflight {input.preflight} "
        "--capture {params.capture:q} --threads {threads} --out {output.table} --csv {output.csv} "
        "--trace {output.trace} > {log} 2>&1"


rule ablation:
    input:
        **FINGERPRINTS,
        preflight="results/preflight/{shape}.json",
    output:
        "results/ablation/{shape}.json",
    params:
        row=row_param,
        protocol=protocol_of("ablation"),
        chunked=json.dumps(config["chunked_check"], sort_keys=True),
        harness=HARNESS_DIGEST,
    priority: row_priority
    log:
        "results/logs/ablation/{shape}.log",
    threads: res("threads")
    resources:
        gpu=1,
        mem_mb=res("mem_mb"),
        runtime=res("runtime"),
    shell:
        "{JOB} ablation --device {DEVICE_ARG} --row {params.row:q} --preflight {input.preflight} "
        "--protocol {params.protocol:q} --chunked {params.chunked:q} --threads {threads} "
        "--out {output} > {log} 2>&1"
