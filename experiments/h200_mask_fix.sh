#!/usr/bin/env bash
# One device call that measures experiments/patches/attention-one-stage2-loop.patch (NOTES, session 9): the masked
# attention kernel with one stage-2 loop for prefix and general masks. Applies the patch to the node's copy of the
# tree (not to the checkout here), then: the attention tests on the GPU (masks, prefix summary), the mask's cost
# kernel by kernel ($OUT/mask-parts-patched.json) and for the whole model ($OUT/mask-cost-patched.json).
# Predicted: masked attention at the key-length path's time (row 6 656 -> ~590 us per layer, row 8 39.3 -> ~29.3);
# the model's mask cost on row 8 5.4 % -> ~1.5 %, row 6 3.2 % -> ~0.5 %.
# Device call (carry [".whl"]): bash experiments/h200_mask_fix.sh
set -uo pipefail
[ -d /tmp/site/snakemake ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/workflow:$PWD PYTHONUNBUFFERED=1
patch -p1 --forward < experiments/patches/attention-one-stage2-loop.patch || exit 1
start=$(date +%s)
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_attention.py > "$OUT/attention-tests.log" 2>&1
echo "attention tests exit status $? after $(( $(date +%s) - start )) s"; tail -n 3 "$OUT/attention-tests.log"
timeout 90 python3 -m experiments.h200_mask_parts "$OUT/mask-parts-patched.json" 2>&1 | grep attention
timeout 200 python3 -m experiments.h200_mask_cost "$OUT/mask-cost-patched.json" 2>&1 | grep "^row"
