#!/usr/bin/env bash
# Run the evidence pipeline on a lent H200 in as few device calls as possible, and bring the results back.
#
# Here (once): ../shared/tools/device-wheels.sh .whl        # snakemake + deps as offline wheels (git-ignored)
# Device call: carry [".whl"], command: [SHAPES=official] bash scripts/h200_pipeline.sh [SECONDS]
# (SHAPES: the manifests to run, default official,contract.) It runs the committed code and policy.
#
# The node has no network: the wheels install into /tmp/site. Snakemake runs with --keep-going under a time
# budget (default 520 s, inside the 600 s limit of one call) and is stopped cleanly when it runs out; the
# results travel back as one archive, $OUT/results.tgz (profiler traces left out: they are large). Call it
# again while the machine is still warm and Snakemake resumes where it stopped (results/ is git-ignored and
# stays on the node between calls of one lease). The report is the DAG's last job, rendered on the node:
# unpack here with `tar xzf results.tgz`, copy results/report/ to reports/h200/ and run
# `shapewise verify reports/h200` (a fresh clone too: every hash it lists must match).
set -uo pipefail
budget=${1:-520}
[ -d /tmp/site/snakemake ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi -L
start=$(date +%s)
timeout --signal=INT --kill-after=30 "$budget" \
    python3 -m snakemake --cores 16 --keep-going --rerun-incomplete --config shapes="${SHAPES:-official,contract}" \
    2>&1 | tail -n 400 > "$OUT/snakemake.log"
echo "snakemake exit status ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s"
tail -n 25 "$OUT/snakemake.log"
tar czf "$OUT/results.tgz" --exclude='*.trace.json' --exclude='*.json.gz' results
ls -la "$OUT"
