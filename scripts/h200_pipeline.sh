#!/usr/bin/env bash
# Run the evidence pipeline on a lent H200 in as few device calls as possible, and bring the results back.
#
# Here (once): ../shared/tools/device-wheels.sh .whl        # snakemake + deps as offline wheels (git-ignored)
# Device call: carry [".whl"], command: [SHAPES=official] bash scripts/h200_pipeline.sh [SECONDS]
# (SHAPES: the manifests to run, default official,contract.) A tuned policy left in results/ by
# scripts/h200_checks.sh on the same warm machine is applied first and comes back in $OUT.
#
# The node has no network: the wheels install into /tmp/site. Snakemake runs with --keep-going under a time
# budget (default 520 s, inside the 600 s limit of one call) and is stopped cleanly when it runs out; the
# results travel back as one archive, $OUT/results.tgz (profiler traces left out: they are large). Call it
# again while the machine is still warm and Snakemake resumes where it stopped (results/ is git-ignored and
# stays on the node between calls of one lease). Unpack here with `tar xzf results.tgz` in the repo root,
# then render and check the report locally: `snakemake --cores all -n` must show only the report job.
set -uo pipefail
budget=${1:-520}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi -L
if [ -f results/routing_policy.json ]; then cp results/routing_policy.json model/routing_policy.json; cp model/routing_policy.json "$OUT/"; fi
start=$(date +%s)
timeout --signal=INT --kill-after=30 "$budget" \
    python3 -m snakemake --cores 16 --keep-going --rerun-incomplete --config shapes="${SHAPES:-official,contract}" \
    2>&1 | tail -n 400 > "$OUT/snakemake.log"
echo "snakemake exit status ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s"
tail -n 25 "$OUT/snakemake.log"
tar czf "$OUT/results.tgz" --exclude='*.trace.json' --exclude='*.json.gz' results
ls -la "$OUT"
