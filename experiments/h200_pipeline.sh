#!/usr/bin/env bash
# Run the evidence pipeline on a lent H200 node (one GPU or several) and bring the results back.
#
# Here (once): ../shared/tools/device-wheels.sh .whl        # snakemake + deps as offline wheels (git-ignored)
# Device call: carry [".whl"] (and "results" to resume an earlier call's run), command:
#   SHAPES=official COMMIT=$(git rev-parse HEAD) bash experiments/h200_pipeline.sh [SECONDS] [SNAKEMAKE ARGS...]
# SHAPES: the manifests (default official). COMMIT: the commit the tree is, recorded in the report's provenance
# (the node gets the working tree without .git). Extra arguments go to snakemake (e.g. --forcerun timing).
#
# The node has no network: the wheels install into /tmp/site. Snakemake runs every GPU of the node (one job per
# GPU) under a time budget (default 520 s, inside the 600 s limit of one call) and is stopped cleanly when it
# runs out. Back in $OUT: results.tgz (results/ without profiler traces), snakemake.log, wall.txt, gpus-check.txt (which
# GPU ran which job, never two on one) and nvidia-smi.txt. Unpack with `tar xzf results.tgz`; carry `results`
# into the next call to resume. The report is the DAG's last job, rendered on the node.
set -uo pipefail
budget=${1:-520}
shift || true
source experiments/device_env.sh
nvidia-smi -L | tee "$OUT/nvidia-smi.txt"
python3 -m shapewise gpus list
start=$(date +%s)
timeout --signal=INT --kill-after=30 "$budget" \
    python3 -m snakemake --cores all --keep-going --rerun-incomplete \
    --config shapes="${SHAPES:-official}" ${COMMIT:+commit=$COMMIT} "$@" > "$OUT/snakemake.log" 2>&1
echo "snakemake exit status $? after $(( $(date +%s) - start )) s" | tee "$OUT/wall.txt"
tail -n 15 "$OUT/snakemake.log"
python3 -m shapewise gpus check results > "$OUT/gpus-check.txt" 2>&1; echo "gpus check exit status $?"
tail -n 5 "$OUT/gpus-check.txt"
tar czf "$OUT/results.tgz" --exclude='trace.json' results
ls -la "$OUT"
