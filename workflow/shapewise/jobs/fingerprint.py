"""The fingerprint job: results/fingerprint/{environment,implementation}.json."""

from __future__ import annotations

from pathlib import Path

from shapewise.jobs.device import setup
from shapewise.jobs.io import header, log, write_result
from shapewise.provenance import inventory
from shapewise.provenance.identity import identity


def main(args):
    if args.kind == "implementation":
        impl = inventory.implementation(Path(args.root))
        if args.dag_digest and impl["digest"] != args.dag_digest:
            raise SystemExit(
                f"the implementation changed while the workflow ran (digest {impl['digest'][:12]} now, "
                f"{args.dag_digest[:12]} when the DAG was built); run snakemake again"
            )
        result = {"step": "fingerprint", "kind": "implementation",
                  "identity": identity(None, args.impl_digest, args.env_digest), **impl}
        log(f"{len(impl['files'])} implementation files, digest {impl['digest']}")
        write_result(args.out, result)
        return 0
    setup(args.device)
    result = header("fingerprint", None, args.device, args)
    result["kind"] = "environment"
    result["dag_digest"] = args.dag_digest
    result["digest"] = inventory.digest_of(inventory.cheap_environment())
    result["packages"] = inventory.installed_packages()
    log(f"environment on {result['environment']['host']}: {result['environment']['machine_key']}")
    write_result(args.out, result)
    return 0
