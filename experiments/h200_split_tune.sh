#!/usr/bin/env bash
# Session 9's tune call, one GPU: is the split layer with launches sized to the token count (ln_qkv column blocks,
# the tail's smaller tiles under 8192 tokens) faster than each official row's route, and what does the official
# call's all-True mask cost on the routes of now?
#   1. GPU tests of the split layer's kernels (tests/test_layer_tail.py), at most 150 s;
#   2. experiments/h200_split_parts.py: ln_qkv launches and tail launches, kernel by kernel, rows of 128 to 1.28 M
#      tokens ($OUT/parts.json);
#   3. experiments/h200_split_layer.py: the model's route against the split layer, whole model, official call
#      ($OUT/split.json);
#   4. experiments/h200_mask_cost.py: model(x, all-True mask) against model(x), rows 1-13 ($OUT/mask.json).
# Device call (carry [".whl"]): bash experiments/h200_split_tune.sh
set -uo pipefail
source experiments/device_env.sh
export PYTHONPATH=$PYTHONPATH:$PWD  # experiments.*
nvidia-smi -L
start=$(date +%s)
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, print its tail
    local name=$1 secs=$2
    shift 2
    timeout --signal=INT --kill-after=10 "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "$name exit status $? after $(( $(date +%s) - start )) s"
    tail -n 4 "$OUT/$name.log"
}
step gpu_tests "${TESTS_SECONDS:-150}" python3 -m pytest -q -rfE -p no:cacheprovider tests/test_layer_tail.py
step parts "${PARTS_SECONDS:-170}" python3 -m experiments.h200_split_parts "$OUT/parts.json" --rows 2,3,4,12,10,13,6 \
    --tail 16/32/4/3,16/64/4/3,16/128/4/2,32/32/4/3,32/64/4/3,64/32/4/3,16/32/2/3,32/32/8/3
step split "${SPLIT_SECONDS:-150}" python3 -m experiments.h200_split_layer "$OUT/split.json" --rows 2,3,4,12,10,1,9,11,5
step mask "${MASK_SECONDS:-120}" python3 -m experiments.h200_mask_cost "$OUT/mask.json"
