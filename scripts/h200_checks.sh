#!/usr/bin/env bash
# One device call: the kernels' launch-configuration sweep, then the whole GPU test suite.
#
# Device call: command `bash scripts/h200_checks.sh` (nothing to carry: torch, triton and pytest are on the node).
# Brings back $OUT/sweep.json and $OUT/gpu_tests.log; commit them under reports/h200/ and quote the log.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 150 python3 scripts/h200_sweep.py "$OUT/sweep.json" 2>&1 | tail -n 80
timeout 420 python3 -m pytest -m gpu -s -p no:cacheprovider tests > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit status $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -n 40
