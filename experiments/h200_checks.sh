#!/usr/bin/env bash
# One device call: the kernels' launch-configuration sweep, the policy it would tune, then the whole GPU
# test suite on the committed policy.
#
# Device call: carry [".whl"] (see experiments/h200_pipeline.sh: the pipeline tests import snakemake), command
# `bash experiments/h200_checks.sh`.
# Brings back $OUT/sweep.json, $OUT/tune.log, $OUT/routing_policy.json (the policy tuned from this sweep:
# review it, commit it as model/routing_policy.json, and measure it in the next call) and $OUT/gpu_tests.log.
# The tests run the committed policy: what a test log says always matches a commit.
set -uo pipefail
source experiments/device_env.sh
nvidia-smi -L
timeout 150 python3 -m experiments.h200_sweep "$OUT/sweep.json" 2>&1 | tail -n 80
cp model/routing_policy.json "$OUT/routing_policy.json"
python3 -m shapewise tune "$OUT/sweep.json" "$OUT/routing_policy.json" > "$OUT/tune.log" 2>&1 \
    || echo "tuning refused: see tune.log"
tail -n 5 "$OUT/tune.log"
timeout 420 python3 -m pytest -m gpu -s -p no:cacheprovider tests > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit status $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -n 40
