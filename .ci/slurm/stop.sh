#!/usr/bin/env bash
# Stop the single-node SLURM started by .ci/slurm/start.sh: cancel remaining
# jobs, then stop slurmd, slurmctld and munged by the PIDs recorded in
# $SHAPEWISE_SLURM_STATE.  Leaves packages, config and the munge key in place,
# so a later start.sh is fast.  Safe to run when nothing is running.
set -uo pipefail
STATE=${SHAPEWISE_SLURM_STATE:-/var/lib/shapewise-slurm}
log() { echo "[slurm-stop] $*" >&2; }

stop_pid() {  # stop_pid NAME PIDFILE
    local name=$1 file=$2 pid
    [ -s "$file" ] || { log "$name: no pid file"; return 0; }
    pid=$(cat "$file")
    if ! kill -0 "$pid" 2>/dev/null; then
        log "$name: not running"; rm -f "$file"; return 0
    fi
    kill -TERM "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name ($pid) ignored TERM, sending KILL"; kill -KILL "$pid" 2>/dev/null
    fi
    rm -f "$file"
    log "$name ($pid) stopped"
}

if [ -s "$STATE/slurmctld.pid" ] && kill -0 "$(cat "$STATE/slurmctld.pid")" 2>/dev/null; then
    scancel --full --quiet --partition="${SHAPEWISE_SLURM_PARTITION:-debug}" 2>/dev/null || true
fi
stop_pid slurmd "$STATE/slurmd.pid"
stop_pid slurmctld "$STATE/slurmctld.pid"
stop_pid munged "$STATE/munged.pid"
exit 0
