#!/usr/bin/env bash
# Session 12's device calls, one GPU (experiments/NOTES.md, session 12).
# Call 1 (CALL=1, the default): experiments/h200_ws_attention.py ($OUT/ws-attention.json): Triton's Hopper warp
#   specialization on row 14's attention against the committed long-sequence tile and cuDNN.
# Calls 2-3: the official pipeline (SHAPES=official COMMIT=<sha> bash experiments/h200_pipeline.sh 565, twice).
# Call 4 (CALL=4, carry [".whl", "results"] from call 3; needs COMMIT): the timing jobs of the rows the pipeline
#   flagged noisy, once more (ROWS, default "01 05 12"; the first run's files stay in
#   experiments/h200/session12/pipeline-call3/results.tgz) and the report re-rendered from them; then
#   experiments/h200_mask_parts.py on rows 11, 10, 9, 1 ($OUT/mask-parts.json): the attention kernel unmasked, with
#   key lengths and with the mask's summary, where the pipeline measured the mask's cost.
# Call 5 (CALL=5): GPU tests of attention's mask loop switch (kernels/attention.py MASK_OWN_LOOP_MAX_BLOCK_D, off
#   in the tree), then experiments/h200_mask_parts.py --own-loop on rows 11, 10, 1, 2, 13, 6 ($OUT/mask-parts.json).
# Call 7 (CALL=7, ran at 94b1010): GPU tests of the fused layer's and the mask summary's switches, then
#   experiments/h200_mask_parts.py --fused-switches on rows 7 and 12 ($OUT/mask-parts.json).
# Device call (carry [".whl"]): [CALL=4 COMMIT=<sha>] bash experiments/h200_session12.sh; step logs in
# $OUT/steps.log.
set -uo pipefail
source experiments/device_env.sh
source experiments/device_step.sh  # step(), $log, $start
if [ "${CALL:-1}" = 4 ]; then
    targets=""
    for r in ${ROWS:-01 05 12}; do targets="$targets results/timing/official-$r.json"; done
    step retime 300 python3 -m snakemake --cores all --keep-going --config shapes=official commit="$COMMIT" \
        --forcerun $targets
    tail -n 4 "$log"
    tar czf "$OUT/results.tgz" --exclude='trace.json' results
    step parts 120 python3 -m experiments.h200_mask_parts "$OUT/mask-parts.json" --rows 11,10,9,1
    grep -E "^[0-9]+ attention" "$log" | tail -n 30
    exit
fi
if [ "${CALL:-1}" = 5 ]; then
    step gpu_tests 150 python3 -m pytest -q -x -rfE -p no:cacheprovider tests/test_attention.py -k "own_loop or mask"
    tail -n 3 "$log"
    step parts 200 python3 -m experiments.h200_mask_parts "$OUT/mask-parts.json" --rows 11,10,1,2,13,6 --own-loop
    grep -E "^[0-9]+ attention" "$log" | tail -n 60
    exit
fi
if [ "${CALL:-1}" = 7 ]; then
    step gpu_tests 100 python3 -m pytest -q -x -rfE -p no:cacheprovider tests/test_fused_layer.py tests/test_mask.py \
        -k "row_mask_branch or summary_paths"
    tail -n 3 "$log"
    step parts 90 python3 -m experiments.h200_mask_parts "$OUT/mask-parts.json" --rows 7,12 --fused-switches
    grep -E "^[0-9]+ fused" "$log" | tail -n 30
    exit
fi
step ws 240 python3 -m experiments.h200_ws_attention "$OUT/ws-attention.json"
grep -E "^(cudnn|committed|[0-9]+/)" "$log" | tail -n 20
