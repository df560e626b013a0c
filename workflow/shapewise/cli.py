"""The `shapewise` command.

  shapewise verify DIR          check a report against its provenance.json (artifacts; inputs against its commit)
  shapewise compare OLD NEW     compare two reports' timings per (machine, row); exit 1 on a regression
  shapewise validate FILE...    check shape manifests, print their rows
  shapewise targets ID...       the per-shape result files of rows (for --forcerun)
  shapewise tune SWEEP [POLICY] write the fused kernel's launch policy from a sweep file
  shapewise gpus list|check     the GPU pool a run would use here; check results/ for one job per GPU at a time
  shapewise job STEP ...        one pipeline job (run by Snakemake)
"""

from __future__ import annotations

import argparse
import os
import sys


def _job_parser(sub):
    """`shapewise job STEP`: one sub-command per step of shapewise.steps, with the options every job takes and the
    step's own (each required)."""
    from shapewise import steps
    from shapewise.settings import devices

    job = sub.add_parser("job", help="run one pipeline job (Snakemake calls this)")
    parsers = job.add_subparsers(dest="step", required=True)
    for name, step in steps.STEPS.items():
        p = parsers.add_parser(name)
        p.add_argument("--device", choices=devices(), required=True)
        p.add_argument("--threads", type=steps.JOB_WIDE["threads"].type, default=None)
        p.add_argument("--out", required=True)
        p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                       help="a SHAPEWISE_* variable the job keeps (config pass_env); every other one is removed")
        p.add_argument("--impl-digest", default=None,
                       help="digest of the implementation (model/, kernels/; a candidate's job: the candidate's), "
                            "recorded in the result's identity")
        p.add_argument("--env-digest", default=None,
                       help="digest of the environment, recorded in the result's identity")
        for option, spec in step.own_options().items():
            p.add_argument(f"--{option}", type=spec.type, required=True)


def build_parser():
    parser = argparse.ArgumentParser(prog="shapewise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="check a report's files and inputs against its provenance.json")
    verify.add_argument("dir")
    verify.add_argument("--artifacts-only", action="store_true",
                        help="skip the inputs (sources, manifests, config): check only the report's own files")
    from shapewise.compare import DEFAULT_FLOORS

    compare = sub.add_parser("compare", help="compare two report directories; exit 1 when the optimized model "
                                             "of a row is slower beyond noise, 2 on unreadable input")
    compare.add_argument("old")
    compare.add_argument("new")
    compare.add_argument("--optimized-floor", type=float, default=None, metavar="FRACTION",
                         help="smallest change of the optimized model's median that counts "
                              f"(default {DEFAULT_FLOORS['optimized']})")
    compare.add_argument("--reference-floor", type=float, default=None, metavar="FRACTION",
                         help="smallest change of the reference's median that counts "
                              f"(default {DEFAULT_FLOORS['reference']})")
    compare.add_argument("--same-gpu", action="store_true",
                         help="match rows by GPU model alone, also across software (torch, Triton, driver, "
                              "packages); the header names both runs' machines")
    validate = sub.add_parser("validate", help="validate shape manifests")
    validate.add_argument("files", nargs="+")
    targets = sub.add_parser("targets", help="per-shape result files of the given row ids")
    targets.add_argument("ids", nargs="+")
    tune = sub.add_parser("tune", help="write the fused launch policy (routing_policy.json) from a sweep file")
    tune.add_argument("sweep")
    tune.add_argument("policy", nargs="?", default=None, help="policy file to rewrite (default: the model's own)")
    gpus = sub.add_parser("gpus", help="the GPU pool of a run (list), or check from result files that jobs "
                                       "ran on several GPUs at once and never two on one (check)")
    gpus_sub = gpus.add_subparsers(dest="gpus_command", required=True)
    gpus_list = gpus_sub.add_parser("list", help="the GPUs a run here would use, one job each")
    gpus_list.add_argument("--gpus", default="all", help="as config gpus: all, a number or GPU ids such as 0,2")
    gpus_check = gpus_sub.add_parser("check", help="exit 1 unless jobs ran on >= --min-gpus GPUs at overlapping "
                                                   "times and never two on one GPU")
    gpus_check.add_argument("results", nargs="?", default="results")
    gpus_check.add_argument("--min-gpus", type=int, default=2)
    _job_parser(sub)
    return parser


def main(argv=None, server_mode=None):
    """`server_mode`: set in a job forked from the run's job server (shapewise.jobserver), the device it serves."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "verify":
        from shapewise.provenance import verify

        return verify(args.dir, artifacts_only=args.artifacts_only)
    if args.command == "compare":
        from shapewise.compare import main as compare_main

        floors = {m: f for m, f in (("optimized", args.optimized_floor), ("reference", args.reference_floor))
                  if f is not None}
        return compare_main(args.old, args.new, floors, err=lambda line: print(line, file=sys.stderr),
                            same_gpu=args.same_gpu)
    if args.command == "validate":
        from shapewise.manifest import ManifestError, load_manifests

        try:
            rows = load_manifests(args.files)
        except ManifestError as exc:
            print(exc, file=sys.stderr)
            return 1
        for row in rows:
            print(f"{row['id']}: B={row['batch_size']} S={row['seq_len']} d={row['d_model']} "
                  f"H={row['num_heads']} ffn={row['ffn_dim']} L={row['num_layers']} {row['dtype']} "
                  f"causal={row['causal']} mask={row['mask']} pass_mask={row['pass_mask']} route={row['route']}")
        print(f"{len(rows)} rows valid")
        return 0
    if args.command == "tune":
        from shapewise.tune import main as tune_main

        return tune_main(args.sweep, args.policy)
    if args.command == "targets":
        import re

        from shapewise import paths
        from shapewise.manifest import load_schema

        pattern = load_schema()["items"]["properties"]["id"]["pattern"]
        bad = [i for i in args.ids if not re.fullmatch(pattern, i)]
        if bad:
            print(f"targets: not a row id: {', '.join(map(repr, bad))} (ids match {pattern})", file=sys.stderr)
            return 2
        print(" ".join(path for i in args.ids for path in paths.per_shape(i).values()))
        return 0
    if args.command == "gpus":
        from shapewise import gpuslots

        if args.gpus_command == "list":
            return gpuslots.list_main(args.gpus)
        return gpuslots.check_main(args.results, args.min_gpus)
    if server_mode is not None:
        return run_job_here(args, argv, server_mode)
    return run_job(args, argv)


PIPELINE_PREFIX = "SHAPEWISE_PIPELINE_"  # the pipeline's own variables (GPU slot pool), never removed


def job_environment_variables(passed):
    """Remove every SHAPEWISE_* variable of the user's shell from this process, except the pipeline's own
    (SHAPEWISE_PIPELINE_*), then set those passed explicitly as NAME=VALUE (config pass_env). Runs before
    anything imports the model, which reads SHAPEWISE_ROUTE and SHAPEWISE_DISABLE."""
    kept = {}
    for item in passed:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("SHAPEWISE_") or name.startswith(PIPELINE_PREFIX):
            raise SystemExit(f"--env {item!r}: expected NAME=VALUE with NAME a SHAPEWISE_* variable "
                             f"(not {PIPELINE_PREFIX}*)")
        kept[name] = value
    for name in [n for n in os.environ if n.startswith("SHAPEWISE_") and not n.startswith(PIPELINE_PREFIX)]:
        del os.environ[name]
    os.environ.update(kept)


def run_job(args, argv):
    """A pipeline job: as a fork of the run's job server where there is one (shapewise.jobserver: it has imported
    torch and the job code already), else in this process; either way its log capped (jobserver.capped_output)."""
    job_environment_variables(getattr(args, "env", []))
    from shapewise import jobserver

    with jobserver.capped_output():
        rc = jobserver.run(args, argv)
        if rc is not None:
            return rc
        return run_job_here(args, argv)


def run_job_here(args, argv, server_mode=None):
    """Run the job in this process (fresh, or forked from the job server that serves `server_mode`)."""
    job_environment_variables(getattr(args, "env", []))
    # A GPU job takes one GPU of the run's pool for its whole run (shapewise.gpuslots), before anything
    # imports torch: CUDA_VISIBLE_DEVICES must be set before CUDA initializes. `auto` is resolved after
    # that. The GPU jobs are those measure.smk gives a GPU (all device jobs but the implementation
    # fingerprint); a job that times holds it alone, the others may share it (gpuslots.GPU_USE). Triton reads
    # TRITON_INTERPRET when it is imported: set it before any job module (the model, the kernels) is imported;
    # torch itself does not import triton.
    from shapewise import gpushare, gpuslots

    mode = None
    if getattr(args, "device", None) is not None:
        from shapewise import cpus

        def pin():
            # holding a slot of the local lock pool: the CPU cores of that slot (shapewise.cpus), before torch is
            # imported (also by `auto`): its threads and the compile subprocesses (ptxas) stay on these cores
            try:
                cpus.pin_job()
            except cpus.CpuSlotError as exc:
                raise SystemExit(f"{args.step} job: cannot pin its GPU slot's CPU cores: {exc}") from None

        needs_gpu = not (args.step == "fingerprint" and args.kind == "implementation")
        try:
            mode = gpuslots.job_mode(args.step)
        except gpuslots.GpuError as exc:
            raise SystemExit(f"{args.step} job: {exc}") from None
        why = None
        if mode == gpuslots.SHARED and args.device != "cpu" and os.environ.get(gpuslots.POOL_VAR):
            # nothing would keep it from choosing kernels by timing beside other jobs, or its row's memory would
            # leave too little for them
            why = gpushare.unavailable() or gpuslots.memory_alone(getattr(args, "preflight", None))
            if why:
                print(f"job process: holds its GPU alone: {why}", file=sys.stderr, flush=True)
                mode = gpuslots.EXCLUSIVE
        args.device = gpuslots.enter_job(args.device, needs_gpu=needs_gpu, label=f"{args.step} {args.out}",
                                         on_slot=pin, mode=mode, why=why)
    if server_mode is not None and args.device != server_mode:
        from shapewise.jobserver import RunFresh

        slot = gpuslots.held()
        if slot is not None:
            slot.release()
        raise RunFresh(f"the job runs on {args.device}, the job server serves {server_mode}")
    if getattr(args, "device", None) == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import importlib

    if args.device == "cuda" and gpuslots.held() is not None:
        gpushare.install(warm=args.step == "warmup",
                         alone_until_chosen=os.environ.get(gpuslots.USE_VAR) == gpuslots.EXCLUSIVE)
    from shapewise import steps

    module = importlib.import_module(steps.STEPS[args.step].module)
    try:
        return module.main(args)
    except gpushare.NeedsExclusiveGPU as exc:
        if server_mode is not None:
            raise  # the client asks the job server for a fork that holds the GPU alone
        # a fresh process: start again as a new one (this one's CUDA state is taken), holding the GPU alone
        print(f"job process: runs again holding its GPU alone: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.environ[gpuslots.USE_VAR] = gpuslots.EXCLUSIVE
        os.execv(sys.executable, [sys.executable, "-m", "shapewise", *argv])


if __name__ == "__main__":
    raise SystemExit(main())
