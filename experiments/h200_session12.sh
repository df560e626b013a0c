#!/usr/bin/env bash
# Session 12's device calls, one GPU (experiments/NOTES.md, session 12).
# Call 1 (CALL=1, the default): experiments/h200_ws_attention.py ($OUT/ws-attention.json): Triton's Hopper warp
#   specialization on row 14's attention against the committed long-sequence tile and cuDNN.
# Device call (carry [".whl"]): bash experiments/h200_session12.sh; step logs in $OUT/steps.log.
set -uo pipefail
source experiments/device_env.sh
source experiments/device_step.sh  # step(), $log, $start
step ws 240 python3 -m experiments.h200_ws_attention "$OUT/ws-attention.json"
grep -E "^(cudnn|committed|[0-9]+/)" "$log" | tail -n 20
