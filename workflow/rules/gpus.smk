# The GPU pool of this run (shapewise.gpuslots): every GPU `nvidia-smi -L` lists, narrowed by the user's
# CUDA_VISIBLE_DEVICES and by config `gpus` (all | a count | GPU ids such as "0,2").
#
# - Snakemake's global `gpu` resource becomes the pool's size, so `snakemake --cores all` runs as many GPU
#   jobs at once as there are GPUs (at least 1: on a machine without GPUs the device jobs run one at a time
#   on the CPU). `--resources gpu=K` on the command line (or in a profile) wins.
# - The pool goes to every job through the environment (SHAPEWISE_PIPELINE_GPUS), not through the shell
#   command: a different GPU count reruns nothing. Each GPU job locks one GPU of it (shapewise.cli).
# - Only the main Snakemake process does this; a job started by a cluster executor re-reads this file on
#   its node, where SLURM has chosen the GPU.

from shapewise import gpuslots as sw_gpuslots
from shapewise import paths as sw_paths

if workflow.is_main_process:
    try:
        GPU_POOL = [] if DEVICE_ARG == "cpu" else sw_gpuslots.resolve_pool(config["gpus"])
    except sw_gpuslots.GpuError as exc:
        raise WorkflowError(f"{exc} (set config gpus in {sw_paths.CONFIG_FILE} or with --config gpus=...)") from None
    if DEVICE_ARG == "cpu" and config["gpus"] != "all":
        print(f"note: config gpus={config['gpus']!r} is ignored: the device is cpu", file=sys.stderr)
    os.environ[sw_gpuslots.POOL_VAR] = sw_gpuslots.pool_value(GPU_POOL)
    os.environ[sw_gpuslots.RUN_SLURM_VAR] = os.environ.get("SLURM_JOB_ID", "")
    if "gpu" not in workflow.global_resources:
        workflow.register_resource("gpu", max(1, len(GPU_POOL)))
        _gpu_from = "this machine's GPU pool" if GPU_POOL else "no GPU here: device jobs one at a time"
    else:
        _gpu_from = "--resources"
    print(
        f"GPU pool: {sw_gpuslots.pool_value(GPU_POOL) or 'none'}; at most "
        f"{workflow.global_resources['gpu'].value} GPU job(s) at once (gpu resource, from {_gpu_from})",
        file=sys.stderr,
    )
