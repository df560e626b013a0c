#!/usr/bin/env bash
# One device call that measures the prepared mask-cost fixes of session 9 (experiments/NOTES.md, session 9):
# - experiments/patches/attention-one-stage2-loop.patch: the masked attention kernel with one stage-2 loop for
#   prefix and general masks. Predicted: masked attention at the key-length path's time (row 6 656 -> ~590 us per
#   layer, row 8 39.3 -> ~29.3); the model's mask cost on row 8 5.4 % -> ~1.5 %, row 6 3.2 % -> ~0.5 %.
# - experiments/patches/split-prefix-in-ln-qkv.patch: on the split layer, layer 0's ln_qkv writes the mask's prefix
#   summary in its own launch (one graph node less). Predicted: ~1 us per forward on rows 1-5, 9-11, 13.
# Applies the patches named (default: both) to the node's copy of the tree (not to the checkout here), then: the
# GPU tests of the patched kernels, the mask's cost kernel by kernel ($OUT/mask-parts-patched.json) and for the
# whole model ($OUT/mask-cost-patched.json).
# Device call (carry [".whl"]): bash experiments/h200_mask_fix.sh [experiments/patches/NAME.patch ...]
set -uo pipefail
source experiments/device_env.sh
export PYTHONPATH=$PYTHONPATH:$PWD  # experiments.*
for p in "${@:-experiments/patches/attention-one-stage2-loop.patch experiments/patches/split-prefix-in-ln-qkv.patch}"; do
    for one in $p; do patch -p1 --forward < "$one" || exit 1; done
done
start=$(date +%s)
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_attention.py tests/test_layer_tail.py tests/test_mask.py \
    > "$OUT/patched-tests.log" 2>&1
echo "GPU tests exit status $? after $(( $(date +%s) - start )) s"; tail -n 3 "$OUT/patched-tests.log"
timeout 90 python3 -m experiments.h200_mask_parts "$OUT/mask-parts-patched.json" 2>&1 | grep attention
timeout 200 python3 -m experiments.h200_mask_cost "$OUT/mask-cost-patched.json" 2>&1 | grep "^row"
