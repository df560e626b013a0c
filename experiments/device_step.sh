# Sourced by the session scripts (experiments/h200_session*.sh) after device_env.sh: `step NAME SECONDS COMMAND...`
# runs COMMAND with a time limit, appends its output to $log ($OUT/steps.log) and prints its exit status with the
# seconds since the script sourced this file ($start). Also puts the repository root on the path (experiments.*).
export PYTHONPATH=$PYTHONPATH:$PWD
start=$(date +%s)
log="$OUT/steps.log"
step() {
    local name=$1 secs=$2 status
    shift 2
    echo "===== $name" >> "$log"
    timeout --signal=INT --kill-after=10 "$secs" "$@" >> "$log" 2>&1
    status=$?
    echo "$name exit status $status after $(( $(date +%s) - start )) s" | tee -a "$log"
    return $status
}
