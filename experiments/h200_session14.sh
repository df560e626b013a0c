#!/usr/bin/env bash
# Session 14's experiment calls, one GPU (experiments/NOTES.md, session 14), before a switch is turned on.
# CALL=1 (ran at 7c15e89): the fused layer's two mask switches of then (DEFER_SUMMARY, FULL_MASK_BRANCH_MAX_D_MODEL;
#   both measured slower and removed since) and the host's path of a call:
#   GPU tests of the fused layer's mask paths; kernel by kernel on official rows 7 and 12, each switch off and on
#   (experiments.h200_mask_parts); whole model, rows 7 and 12, the mask cost under each setting, paired rounds
#   (experiments.h200_mask_cost --switch-ab); the host's and the GPU's time per call on rows 2, 3, 7, 12
#   (experiments.host_path --cuda).
# CALL=2 (default; ran at 8aa2a3b): the same for the switch that replaced them (UNMASKED_FIRST_MAX_D_MODEL, measured
#   slower too and removed), without the host path. Neither call runs at a later commit: their switches are gone.
# Step logs in $OUT/steps.log.
set -uo pipefail
source experiments/device_env.sh
source experiments/device_step.sh  # step(), $log, $start
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
if [ "${CALL:-2}" = 1 ]; then
    step gpu-tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_fused_layer.py \
        -k "deferred or full_mask_branch or summary_paths or reach or row_mask_branch_off"
    tail -n 3 "$log"
    step mask-parts 120 python3 -m experiments.h200_mask_parts "$OUT/mask-parts.json" --rows 7,12 --full-branch \
        --defer-summary
    step switch-ab 120 python3 -m experiments.h200_mask_cost "$OUT/switch-ab.json" --rows "" --switch-ab 7,12
    step host-path 120 python3 -m experiments.host_path --cuda "$OUT/host-path.json" 2 3 7 12
    exit 0
fi
step gpu-tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_fused_layer.py \
    -k "unmasked_first or summary_paths or reach or row_mask_branch_off"
tail -n 3 "$log"
step mask-parts 120 python3 -m experiments.h200_mask_parts "$OUT/mask-parts.json" --rows 7,12 --unmasked-first
step switch-ab 120 python3 -m experiments.h200_mask_cost "$OUT/switch-ab.json" --rows "" --switch-ab 7,12
