#!/usr/bin/env bash
# Prepared in session 14 for the next device session, one GPU (experiments/NOTES.md, session 14, "prepared"):
# kernels/fused_layer.py KEY_MASK_BRANCH (on: the committed branch) against off (the keys' mask predicated off for a
# prefix), measured before it is changed:
# 1. GPU tests of the fused layer's mask paths with each mask-load switch off (the interpreter's CPU run: tests/).
# 2. Kernel by kernel, official rows 7 and 12 (experiments.h200_mask_parts --key-mask-branch).
# 3. Whole model, rows 7 and 12: the paired mask cost, committed against KEY_MASK_BRANCH off
#    (experiments.h200_mask_cost --switch-ab; SWITCH_SETTINGS).
# Device call (carry [".whl"]): bash experiments/h200_session15.sh. Step logs in $OUT/steps.log.
# Ran at 7b9ff0b (session 15, call 1: experiments/h200/session15/call1/); the switch was measured slower and removed
# after it, with --key-mask-branch, so this script runs only at that commit.
set -uo pipefail
source experiments/device_env.sh
source experiments/device_step.sh  # step(), $log, $start
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
step gpu-tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_fused_layer.py -k "summary_paths or switches"
tail -n 3 "$log"
step mask-parts 120 python3 -m experiments.h200_mask_parts "$OUT/mask-parts.json" --rows 7,12 --key-mask-branch
step switch-ab 120 python3 -m experiments.h200_mask_cost "$OUT/switch-ab.json" --rows "" --switch-ab 7,12
