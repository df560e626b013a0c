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
import re
import sys

from shapewise.execution import gpuslots, jobserver
from shapewise.execution.jobprocess import add_job_parser, job_environment_variables, run_job_here
from shapewise.inputs import paths
from shapewise.inputs.manifest import ManifestError, load_manifests, load_schema
from shapewise.provenance.provenance import verify
from shapewise.report.compare import DEFAULT_FLOORS
from shapewise.report.compare import main as compare_main


def build_parser():
    parser = argparse.ArgumentParser(prog="shapewise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="check a report's files and inputs against its provenance.json")
    verify.add_argument("dir")
    verify.add_argument("--artifacts-only", action="store_true",
                        help="skip the inputs (sources, manifests, config): check only the report's own files")
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
    add_job_parser(sub)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "verify":
        return verify(args.dir, artifacts_only=args.artifacts_only)
    if args.command == "compare":
        floors = {m: f for m, f in (("optimized", args.optimized_floor), ("reference", args.reference_floor))
                  if f is not None}
        return compare_main(args.old, args.new, floors, err=lambda line: print(line, file=sys.stderr),
                            same_gpu=args.same_gpu)
    if args.command == "validate":
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
        from shapewise.tune import main as tune_main  # deferred: tune reads shapes/official.yaml when imported

        return tune_main(args.sweep, args.policy)
    if args.command == "targets":
        pattern = load_schema()["items"]["properties"]["id"]["pattern"]
        bad = [i for i in args.ids if not re.fullmatch(pattern, i)]
        if bad:
            print(f"targets: not a row id: {', '.join(map(repr, bad))} (ids match {pattern})", file=sys.stderr)
            return 2
        print(" ".join(path for i in args.ids for path in paths.per_shape(i).values()))
        return 0
    if args.command == "gpus":
        if args.gpus_command == "list":
            return gpuslots.list_main(args.gpus)
        return gpuslots.check_main(args.results, args.min_gpus)
    return run_job(args, argv)


def run_job(args, argv):
    """A pipeline job: as a fork of the run's job server where there is one (shapewise.execution.jobserver: it has
    imported torch and the job code already), else in this process; either way its log capped
    (jobserver.capped_output)."""
    job_environment_variables(getattr(args, "env", []))
    with jobserver.capped_output():
        rc = jobserver.run(args, argv)
        if rc is not None:
            return rc
        return run_job_here(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
