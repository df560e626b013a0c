#!/usr/bin/env bash
# Issue #14's evidence in one device call: the official manifest's timing jobs (with the preflight,
# fingerprints and microbenchmarks they need) twice back to back on the same node and commit, then
# `shapewise compare` of the two runs' results directories (no report is rendered: compare reads timing/*.json).
# Device call: carry [".whl"], command: COMMIT=<sha> bash experiments/h200_repro.sh [RUN1_SECONDS] [RUN2_SECONDS]
# Back in $OUT: snakemake-run{1,2}.log, compare.txt, timing-runs.tgz (run1/timing, results/timing, the logs).
set -uo pipefail
source experiments/device_env.sh
nvidia-smi -L | tee "$OUT/nvidia-smi.txt"
targets=(); for r in 01 02 03 04 05 06 07 08 09 10 11 12 13 14; do targets+=("results/timing/official-$r.json"); done
for run in 1 2; do
    budget=${1:-240}; [ "$run" = 2 ] && budget=${2:-200}
    extra=(); [ "$run" = 2 ] && extra=(--forcerun timing)
    start=$(date +%s)
    timeout --signal=INT --kill-after=20 "$budget" python3 -m snakemake "${targets[@]}" --cores all --keep-going \
        --rerun-incomplete --config shapes=official ${COMMIT:+commit=$COMMIT} "${extra[@]}" \
        > "$OUT/snakemake-run$run.log" 2>&1
    echo "run $run: snakemake exit status $? after $(( $(date +%s) - start )) s"; tail -n 3 "$OUT/snakemake-run$run.log"
    [ "$run" = 1 ] && { rm -rf run1 && mkdir run1 && cp -a results/timing run1/timing; }
done
python3 -m shapewise compare run1 results > "$OUT/compare.txt" 2>&1; echo "compare exit status $?"
cat "$OUT/compare.txt"
tar czf "$OUT/timing-runs.tgz" run1/timing results/timing results/logs/timing results/logs/preflight results/preflight
