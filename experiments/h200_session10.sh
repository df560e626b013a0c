#!/usr/bin/env bash
# Session 10's first device call, one GPU: check and measure the mask-cost changes, then start the official
# pipeline in what is left of the call (experiments/NOTES.md, session 10).
#   1. GPU tests of the changed kernels (attention, layer tail and ln_qkv, mask summary, fused layer), at most
#      TESTS_SECONDS (default 170);
#   2. experiments/h200_mask_parts.py: the all-True mask's cost kernel by kernel ($OUT/mask-parts.json), to hold
#      against experiments/h200/session9/mask-parts.json;
#   3. experiments/h200_row14_attention.py: row 14's attention, our tiles against cuDNN ($OUT/row14-attention.json);
#   4. unless a GPU test failed: experiments/h200_pipeline.sh with the rest of BUDGET seconds (default 560), its
#      files in $OUT as that script leaves them (results.tgz to carry into the next call as `results`).
# Device call (carry [".whl"]): COMMIT=$(git rev-parse HEAD) bash experiments/h200_session10.sh
# The step logs go to $OUT/steps.log (a call brings back at most 8 files).
set -uo pipefail
source experiments/device_env.sh
source experiments/device_step.sh  # step(), $log, $start
step gpu_tests "${TESTS_SECONDS:-170}" python3 -m pytest -q -x -rfE -p no:cacheprovider tests/test_attention.py \
    tests/test_layer_tail.py tests/test_mask.py tests/test_fused_layer.py
tests=$?
tail -n 3 "$log"
step parts 100 python3 -m experiments.h200_mask_parts "$OUT/mask-parts.json"
grep -E "attention|tail|fused|prefix" "$log" | tail -n 40
step row14 100 python3 -m experiments.h200_row14_attention "$OUT/row14-attention.json"
grep -E "^(cudnn|best|[0-9]+/)" "$log" | tail -n 10
if [ "$tests" = 1 ]; then
    echo "a GPU test failed: no pipeline run"
    exit 1
fi
left=$(( ${BUDGET:-560} - ($(date +%s) - start) ))
echo "pipeline with $left s"
bash experiments/h200_pipeline.sh "$left"
