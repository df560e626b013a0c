#!/usr/bin/env bash
# The second device call of a session, right after experiments/h200_pipeline.sh on the same (still warm) node:
#   1. the GPU tests of the masked paths and of graphs that read repeated inputs in place;
#   2. the timing jobs again (a second back-to-back run of the same commit), then `shapewise compare` of the two
#      reports (issue #14's evidence: how far the medians of two runs move);
#   3. experiments/h200_memory.py (issue #16: rows 14 and 6 streamed, uncapped and under memory caps).
# Device call: carry [".whl"], command: COMMIT=<sha> bash experiments/h200_rerun.sh
# Stops at once when the node has no finished report (a cold node: run h200_pipeline.sh first).
set -uo pipefail
[ -f results/report/report.md ] || { echo "no results/report on this node (cold machine?): nothing to rerun"; exit 3; }
source experiments/device_env.sh
start=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_official.py -m gpu \
    -k "in_place or (masked and S100 and (all_true or holes or prefix))" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit status $? after $(( $(date +%s) - start )) s"; tail -n 3 "$OUT/gpu_tests.log"
rm -rf results/report-run1 && cp -a results/report results/report-run1
timeout --signal=INT --kill-after=20 270 python3 -m snakemake --cores all --keep-going \
    --config shapes="${SHAPES:-official}" ${COMMIT:+commit=$COMMIT} --forcerun timing > "$OUT/snakemake-rerun.log" 2>&1
echo "timing rerun exit status $? after $(( $(date +%s) - start )) s"; tail -n 5 "$OUT/snakemake-rerun.log"
python3 -m shapewise compare results/report-run1 results/report > "$OUT/compare.txt" 2>&1
echo "compare exit status $?"; tail -n 25 "$OUT/compare.txt"
timeout 150 python3 -m experiments.h200_memory "$OUT/memory.json" > "$OUT/memory.log" 2>&1
echo "memory check exit status $? after $(( $(date +%s) - start )) s"; tail -n 12 "$OUT/memory.log"
tar czf "$OUT/results-rerun.tgz" --exclude='trace.json' results/timing results/report results/report-run1 results/logs/timing
ls -la "$OUT"
