#!/usr/bin/env bash
# Issue #15, item 5: the whole official DAG of one commit on ONE GPU of a node, to set beside the same commit's
# two-GPU run. One GPU needs about twice the 600 s of one device call, so the run is made in two parts on the
# same (warm) machine, and its wall time is the sum of the two parts' walls:
#   part 1: every job of rows official-01..07 (and the fingerprints and microbenchmarks they need);
#   part 2: the whole DAG (rows 08..14 and the report; part 1's results are complete and are not rerun).
# On one GPU the GPU jobs run one after another in both cases, so splitting costs only a second DAG build.
#
# Here (once): ../shared/tools/device-wheels.sh .whl; the commit's tree in .runs/<sha> (git-ignored):
#   mkdir -p .runs/SHA && git archive SHA | tar x -C .runs/SHA
# Device calls (carry [".whl", ".runs"]), the second straight after the first, on the same warm machine:
#   COMMIT=<sha> bash experiments/h200_one_gpu.sh 1 [SECONDS]
#   COMMIT=<sha> bash experiments/h200_one_gpu.sh 2 [SECONDS]
# The run happens in /tmp/one-gpu/<sha> (a copy of the tree, outside the carried paths, so that part 2 finds part
# 1's results), with its own Triton cache, empty at the start of part 1 (as on the bare machine of a two-GPU run).
# Back in $OUT: wall-partN.txt, snakemake-partN.log, topology.txt (part 1), results-partN.tgz, and after part 2
# gpus-check.txt and the report.
set -uo pipefail
part=${1:?part 1 or 2}
budget=${2:-570}
root=$PWD
: "${COMMIT:?COMMIT=<full sha of the tree in .runs/>}"
run=/tmp/one-gpu/$COMMIT
device_code=$run source experiments/device_env.sh  # the shapewise package of the copied tree
export TRITON_CACHE_DIR=/tmp/one-gpu/triton-cache
if [ "$part" = 1 ]; then
    rm -rf /tmp/one-gpu && mkdir -p "$run" "$TRITON_CACHE_DIR" && cp -a "$root/.runs/$COMMIT/." "$run/" || exit 1
    { nvidia-smi -L; lscpu; lscpu -e; } > "$OUT/topology.txt" 2>&1
    targets=()
    for r in 01 02 03 04 05 06 07; do
        for step in preflight accuracy timing ablation; do targets+=("results/$step/official-$r.json"); done
        targets+=("results/profile/official-$r/kernels.json")
    done
else
    [ -d "$run/results" ] || { echo "part 2: no part-1 results in $run (the machine went back?)"; exit 1; }
    targets=()
fi
cd "$run" || exit 1
start=$(date +%s.%N)
timeout --signal=INT --kill-after=30 "$budget" \
    python3 -m snakemake "${targets[@]}" --cores all --keep-going --rerun-incomplete \
    --config shapes=official commit="$COMMIT" gpus=1 \
    > "$OUT/snakemake-part$part.log" 2>&1
status=$?
end=$(date +%s.%N)
printf 'part %s: snakemake exit status %s, start %s, end %s, wall %.1f s\n' "$part" "$status" "$start" "$end" \
    "$(python3 -c "print($end - $start)")" | tee "$OUT/wall-part$part.txt"
tail -n 6 "$OUT/snakemake-part$part.log"
tar czf "$OUT/results-part$part.tgz" --exclude='trace.json' results
if [ "$part" = 2 ]; then
    python3 -m shapewise gpus check --min-gpus 1 results > "$OUT/gpus-check.txt" 2>&1; echo "gpus check exit status $?"
    tail -n 5 "$OUT/gpus-check.txt"
fi
ls -la "$OUT"
