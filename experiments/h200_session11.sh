#!/usr/bin/env bash
# Session 11's device calls, one GPU (experiments/NOTES.md, session 11).
# Call 1 (CALL=1, the default): check and measure the session's kernel changes before any pipeline run:
#   1. GPU tests of the changed kernels (attention, fused layer, layer tail, mask summary), at most TESTS_SECONDS
#      (default 170);
#   2. experiments/h200_mask_parts.py ($OUT/mask-parts.json): the all-True mask kernel by kernel, with the fused
#      layer under each way of reading the mask tried at a5dfab5 (rows 7, 12; since replaced by the summary
#      paths) and the attention register cap never / by grid / always (rows 1-6, 13), as run at a5dfab5;
#   3. experiments/h200_row14_attention.py ($OUT/row14-attention.json): row 14's attention against cuDNN, after the
#      scale folded into the exponent and the causal blocks run longest first, with larger tiles tried.
# Call 2 (CALL=2; needs COMMIT): GPU tests of the fused layer and the model's routes (at most 120 s), the fused
#   layer's mask summary kernel by kernel on rows 7 and 12 ($OUT/mask-parts.json), then, unless a test failed,
#   experiments/h200_pipeline.sh with the rest of BUDGET seconds (default 560).
# Device call (carry [".whl"]): [CALL=2 COMMIT=$(git rev-parse HEAD)] bash experiments/h200_session11.sh
# The step logs go to $OUT/steps.log.
set -uo pipefail
source experiments/device_env.sh
source experiments/device_step.sh  # step(), $log, $start
if [ "${CALL:-1}" = 2 ]; then
    step gpu_tests 120 python3 -m pytest -q -x -rfE -p no:cacheprovider tests/test_fused_layer.py \
        tests/test_model_routes.py
    tests=$?
    tail -n 3 "$log"
    step parts 60 python3 -m experiments.h200_mask_parts "$OUT/mask-parts.json" --rows 7,12
    grep -E "^[0-9]+ fused" "$log"
    [ "$tests" = 0 ] || { echo "a GPU test failed: no pipeline run"; exit 1; }
    left=$(( ${BUDGET:-560} - ($(date +%s) - start) ))
    echo "pipeline with $left s"
    bash experiments/h200_pipeline.sh "$left"
    exit
fi
step gpu_tests "${TESTS_SECONDS:-170}" python3 -m pytest -q -x -rfE -p no:cacheprovider \
    tests/test_fused_layer.py tests/test_attention.py tests/test_layer_tail.py tests/test_mask.py
tail -n 3 "$log"
step parts 150 python3 -m experiments.h200_mask_parts "$OUT/mask-parts.json" --rows 7,12,2,3,4,1,5,13,6 --cap-ab
grep -E "^[0-9]+ (attention|fused|tail)" "$log" | tail -n 60
step row14 130 python3 -m experiments.h200_row14_attention "$OUT/row14-attention.json" \
    --configs 128/64/8/3,128/64/8/2,256/64/16/3,256/64/16/2,128/128/8/3
grep -E "^(cudnn|best|[0-9]+/)" "$log" | tail -n 10
