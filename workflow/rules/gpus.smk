# The GPU pool of this run (shapewise.execution.gpuslots): every GPU `nvidia-smi -L` lists, narrowed by the user's
# CUDA_VISIBLE_DEVICES and by config `gpus` (all | a count | GPU ids such as "0,2").
#
# - Snakemake's global `gpu` resource becomes the pool's size, so `snakemake --cores all` runs as many jobs that
#   time (timing, ablation, microbench: each holds a GPU alone) at once as there are GPUs (at least 1: on a
#   machine without GPUs the device jobs run one at a time on the CPU, as before), and `gpu_share` that times
#   gpuslots.SHARED_PER_GPU: the jobs that time nothing share GPUs (gpu_resources below).
#   `--resources gpu=K` on the command line (or in a profile) wins. Registered while the workflow is read: the
#   scheduler takes them from there; reading the pool writes nothing.
# - The run itself starts in the onstart handler below, the one place that sets what the jobs inherit (the pool,
#   the run's identity for its job server, its Triton cache) and writes the run's marker:
#   shapewise.execution.runs.begin, which refuses the run while another one of this checkout is going on (after
#   `snakemake --unlock`). Snakemake calls it once per invocation, in its main process, after building the DAG and
#   before the first job; not in a dry run, when there is nothing to do, or with --no-hooks (then each job starts
#   fresh, without the job server, and locks a GPU of all those here).
# - Only the main Snakemake process does this; a job started by a cluster executor re-reads this file on
#   its node, where SLURM has chosen the GPU.

from shapewise.execution import gpuslots as sw_gpuslots
from shapewise.execution import runs as sw_runs
from shapewise.inputs import paths as sw_paths
from shapewise.inputs import steps as sw_steps

GPU_POOL = []
if workflow.is_main_process:
    try:
        GPU_POOL = [] if DEVICE_ARG == "cpu" else sw_gpuslots.resolve_pool(config["gpus"])
    except sw_gpuslots.GpuError as exc:
        raise WorkflowError(f"{exc} (set config gpus in {sw_paths.CONFIG_FILE} or with --config gpus=...)") from None
    if DEVICE_ARG == "cpu" and config["gpus"] != "all":
        print(f"note: config gpus={config['gpus']!r} is ignored: the device is cpu", file=sys.stderr)
    if "gpu" not in workflow.global_resources:
        workflow.register_resource("gpu", max(1, len(GPU_POOL)))
        _gpu_from = "this machine's GPU pool" if GPU_POOL else "no GPU here: device jobs one at a time"
    else:
        _gpu_from = "--resources"
    _gpus = workflow.global_resources["gpu"].value
    if "gpu_share" not in workflow.global_resources:
        workflow.register_resource("gpu_share", _gpus * sw_gpuslots.SHARED_PER_GPU)
    _share = (
        f"; jobs that time nothing share a GPU, at most {sw_gpuslots.SHARED_PER_GPU} per GPU (gpu_share "
        f"resource {workflow.global_resources['gpu_share'].value})"
        if GPU_POOL
        else ""
    )
    if GPU_POOL or _gpu_from == "--resources":
        print(
            f"GPU pool: {sw_gpuslots.pool_value(GPU_POOL) or 'none'}; at most "
            f"{_gpus} GPU job(s) at once (gpu resource, from {_gpu_from}) that time{_share}",
            file=sys.stderr,
        )
    else:
        _why = (
            "device cpu (config device or SHAPEWISE_DEVICE)"
            if DEVICE_ARG == "cpu"
            else "no GPU found (`nvidia-smi -L` lists none)"
        )
        _what = (
            "the CPU smoke test (shapes/smoke.yaml, in Triton's interpreter: not a performance measurement)"
            if config["shapes"] == "auto"
            else f"{', '.join(MANIFESTS)} on the CPU"
        )
        print(f"GPU pool: none: {_why}; the jobs run {_what}, one device job at a time", file=sys.stderr)


onstart:
    try:
        sw_runs.begin(
            GPU_POOL,
            sys.argv,
            memory_parts=config["gpu_memory_parts"],
            prepare_shared=config["gpu_prepare_shared"],
        )
    except sw_runs.RunConflict as exc:
        raise WorkflowError(str(exc)) from None


# The run's last words: where its report is, or which jobs failed or did not finish, with their logs (read from
# Snakemake's own log of the run, `log`); Snakemake's "At least one job did not complete successfully" names none.
onsuccess:
    if _said := sw_runs.success_message():
        print(_said, file=sys.stderr)


onerror:
    print(sw_runs.error_message(log), file=sys.stderr)


def gpu_resources(step, uses_gpu=None, heavy=None):
    """The `gpu` and `gpu_share` resources of a job of `step` (its GPU use in shapewise.inputs.steps; `gpu` of a step
    whose jobs may run without a GPU: a function of the wildcards). A local run with GPUs: a job that times takes one
    GPU and all of its share (gpu=1, gpu_share=SHARED_PER_GPU), one that times nothing one share and no GPU of its
    own (gpu=0, gpu_share=1), so Snakemake starts nothing beside a job that times on a one-GPU machine and up to
    SHARED_PER_GPU jobs that time nothing per GPU; the GPU locks place them (shapewise.execution.gpuslots). With
    config gpu_prepare_shared a job of a step that prepares (timing, ablation) asks as one that times nothing, but
    on a heavy row: it builds its models sharing its GPU, and its lock, not Snakemake, keeps every other job off
    the GPU while it times.
    Elsewhere (a
    cluster executor, no GPU here) every GPU job asks for one GPU, as SLURM is to give it. Functions: the
    executor is known once the DAG is built, after this file is read. `uses_gpu(wildcards)`: False for a job of
    the step that runs without a GPU (neither resource); `heavy(wildcards)`: True for a job of a step that prepares
    which holds its GPU alone from its start (a heavy row)."""
    exclusive = sw_steps.STEPS[step].gpu == sw_steps.EXCLUSIVE
    prepares = exclusive and sw_steps.STEPS[step].prepares and config["gpu_prepare_shared"]

    def alone(wildcards):
        if not prepares:
            return exclusive
        # a heavy row's job holds its GPU alone from its start (its estimate is above one part): the whole GPU
        return heavy is not None and heavy(wildcards)

    def sharing():
        return workflow.is_main_process and workflow.local_exec and bool(GPU_POOL)

    def gpu(wildcards):
        if uses_gpu is not None and not uses_gpu(wildcards):
            return 0
        return (1 if alone(wildcards) else 0) if sharing() else 1

    def gpu_share(wildcards):
        if uses_gpu is not None and not uses_gpu(wildcards):
            return 0
        return (sw_gpuslots.SHARED_PER_GPU if alone(wildcards) else 1) if sharing() else 0

    return {"gpu": gpu, "gpu_share": gpu_share}
