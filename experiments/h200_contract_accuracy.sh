#!/usr/bin/env bash
# The pipeline's own preflight and accuracy jobs (5 trials, official and strict tolerance) on chosen rows of
# shapes/contract.yaml, without the rest of the DAG: a quick check of a routing change on those rows.
# Device call (carry [".whl"]): ROWS="contract-bf16 contract-bf16-padded" bash experiments/h200_contract_accuracy.sh
# Writes $OUT/contract-accuracy/<id>.json (the accuracy job's result) and prints one line per row.
set -uo pipefail
source experiments/device_env.sh
# a standalone job holds a GPU slot of a one-GPU pool, as the pipeline passes it (workflow/shapewise/gpuslots.py)
export SHAPEWISE_PIPELINE_GPUS=${SHAPEWISE_PIPELINE_GPUS:-0}
dir="$OUT/contract-accuracy"
mkdir -p "$dir"
for id in ${ROWS:?name the contract rows in ROWS}; do
    row=$(python3 -c "
import sys
from shapewise.manifest import load_manifest, row_json
rows = {r['id']: r for r in load_manifest('shapes/contract.yaml')}
print(row_json(rows[sys.argv[1]]))" "$id") || exit 1
    python3 -m shapewise job preflight --device "${DEVICE:-cuda}" --row "$row" --headroom 0.85 --out "$dir/$id-preflight.json" \
        > "$dir/$id.log" 2>&1 &&
    python3 -m shapewise job accuracy --device "${DEVICE:-cuda}" --row "$row" --preflight "$dir/$id-preflight.json" \
        --chunked '{"batch_samples": 2, "query_block": 256, "query_samples": 2}' --out "$dir/$id.json" >> "$dir/$id.log" 2>&1
    echo "$id exit status $?"
    python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))
a = r['aggregate']
print(r['status'], r['route'][:70], {k: (v['failed_elements'], round(v['max_abs_error'], 5)) for k, v in a.items()})" \
        "$dir/$id.json" || tail -n 5 "$dir/$id.log"
done
