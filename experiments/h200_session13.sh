#!/usr/bin/env bash
# Session 13's device calls, one GPU (experiments/NOTES.md, session 13).
# Calls 1-2: the official pipeline (SHAPES=official COMMIT=<sha> bash experiments/h200_pipeline.sh 565, twice).
# Call 3 (carry [".whl", "results"] from call 2; needs COMMIT): the timing jobs of the rows the pipeline flagged
#   noisy, once more (ROWS, default "02 03 04 07 12"; the first run's files stay in
#   experiments/h200/session13/pipeline-call2/results.tgz) and the report re-rendered from them; then the contract
#   manifest's rows CONTRACT (default contract-wide): accuracy and timing jobs only, into results-contract/.
# Call 4: the same again (ROWS="02 03 07 12"; call 3's contract step had its targets after --config).
# Calls 5 and 6: the re-time alone once more (ROWS="02 03 07 12" CONTRACT=""); call 6 on a fresh machine (call 5's
#   was given back), whose re-time the report is rendered from whatever it shows.
# Step logs in $OUT/steps.log.
set -uo pipefail
source experiments/device_env.sh
source experiments/device_step.sh  # step(), $log, $start
targets=""
for r in ${ROWS:-02 03 04 07 12}; do targets="$targets results/timing/official-$r.json"; done
step retime 300 python3 -m snakemake --cores all --keep-going --forcerun $targets \
    --config shapes=official commit="$COMMIT"
tail -n 4 "$log"
tar czf "$OUT/results.tgz" --exclude='trace.json' results
[ -n "${CONTRACT-contract-wide}" ] || exit 0  # CONTRACT="": the re-time only
rm -rf results
contract=""
for r in ${CONTRACT-contract-wide}; do contract="$contract results/accuracy/$r.json results/timing/$r.json"; done
step contract 240 python3 -m snakemake --cores all --keep-going $contract --config shapes=contract commit="$COMMIT"
tail -n 4 "$log"
tar czf "$OUT/results-contract.tgz" --exclude='trace.json' results
