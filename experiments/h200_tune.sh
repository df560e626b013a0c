#!/usr/bin/env bash
# One device call that measures what the routing policy is read off, before a pipeline run:
# the host time of forward on the small rows, the split layer against the model's routes
# (experiments/h200_split_layer.py, at most SPLIT_SECONDS), the fused kernel's launch sweep (kv_precompute and
# key blocks included) and the policy tune_policy.py derives from it. Writes $OUT/host.json, $OUT/split.json,
# $OUT/sweep.json, $OUT/routing_policy.json (model/routing_policy.json with the sweep's winners; copy it into
# model/ after reading tune.log).
# Device call (carry [".whl"]): [TESTS="tests/..."] bash experiments/h200_tune.sh [SWEEP_SECONDS] [SPLIT_SECONDS]
#   (defaults 360 and 100; the sweep and the split experiment save after every record). On a node with two GPUs
#   the split experiment, then pytest of TESTS (at most TESTS_SECONDS, default 200; $OUT/gpu_tests.log), run on
#   the second GPU while the sweep runs on the first.
# carry [".whl"]: jsonschema and friends come from the same offline wheels as experiments/h200_pipeline.sh.
set -uo pipefail
source experiments/device_env.sh
nvidia-smi -L
start=$(date +%s)
python3 -m experiments.h200_host_probe "$OUT/host.json" 2>&1 | tail -n 20
echo "host probe done after $(( $(date +%s) - start )) s"
split_and_tests() {
    timeout --signal=INT --kill-after=10 "${2:-100}" python3 -m experiments.h200_split_layer "$OUT/split.json" \
        > "$OUT/split.log" 2>&1
    echo "split layer exit status $? after $(( $(date +%s) - start )) s"
    if [ -n "${TESTS:-}" ]; then  # the new kernels' tests, on this GPU (not the interpreter)
        timeout --signal=INT --kill-after=10 "${TESTS_SECONDS:-200}" python3 -m pytest -q -rfE -p no:cacheprovider \
            $TESTS > "$OUT/gpu_tests.log" 2>&1
        echo "gpu tests exit status $? after $(( $(date +%s) - start )) s"; tail -n 5 "$OUT/gpu_tests.log"
    fi
}
# With two GPUs the split experiment (and TESTS) run on the second one while the sweep runs on the first.
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    CUDA_VISIBLE_DEVICES=1 split_and_tests "$@" > "$OUT/second-gpu.txt" 2>&1 &
    second=$!
else
    split_and_tests "$@"
fi
CUDA_VISIBLE_DEVICES=0 timeout --signal=INT --kill-after=20 "${1:-360}" python3 -m experiments.h200_sweep \
    "$OUT/sweep.json" --fused-only > "$OUT/sweep.log" 2>&1
echo "sweep exit status $? after $(( $(date +%s) - start )) s"; tail -n 5 "$OUT/sweep.log"
[ -n "${second:-}" ] && { wait "$second"; cat "$OUT/second-gpu.txt"; }
tail -c 3000 "$OUT/split.log"
cp model/routing_policy.json "$OUT/routing_policy.json"
python3 -m shapewise tune "$OUT/sweep.json" "$OUT/routing_policy.json" > "$OUT/tune.log" 2>&1
echo "tune_policy exit status $?"; tail -n 30 "$OUT/tune.log"
