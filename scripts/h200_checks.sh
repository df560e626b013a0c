#!/usr/bin/env bash
# One device call: the kernels' launch-configuration sweep, the policy tuned from it, then the whole GPU
# test suite on the tuned policy.
#
# Device call: carry [".whl"] (see scripts/h200_pipeline.sh: the pipeline tests import snakemake), command
# `bash scripts/h200_checks.sh`.
# Brings back $OUT/sweep.json, $OUT/tune.log, $OUT/routing_policy.json (the tuned policy the tests ran) and
# $OUT/gpu_tests.log. Commit the policy as model/routing_policy.json and the rest under reports/h200/.
# The sweep and the tuned policy also stay in results/ (git-ignored) on the node, for a pipeline call that
# follows while the machine is warm: `cp results/routing_policy.json model/ && bash scripts/h200_pipeline.sh`.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi -L
mkdir -p results
timeout 150 python3 scripts/h200_sweep.py "$OUT/sweep.json" 2>&1 | tail -n 80
cp "$OUT/sweep.json" results/sweep.json
python3 scripts/tune_policy.py results/sweep.json model/routing_policy.json > "$OUT/tune.log" 2>&1 \
    && cp model/routing_policy.json results/routing_policy.json "$OUT/" || echo "tuning failed: policy unchanged"
tail -n 5 "$OUT/tune.log"
timeout 420 python3 -m pytest -m gpu -s -p no:cacheprovider tests > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit status $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -n 40
