#!/usr/bin/env bash
# Start N jaxtron processes on this machine, joined into one JAX distributed run (for tests and demos).
#
#   scripts/launch_local.sh N [--devices D] -- [python -m jaxtron.train arguments ...]
#
# The machine's CPU devices are split among the processes: each gets D (default 8/N) virtual CPU devices, so
# the global mesh has N*D devices (parallel.* sizes are global). Set JAXTRON_LAUNCH_MODULE to run another
# module than jaxtron.train. If any process fails, the others are stopped (SIGTERM, then SIGKILL after
# JAXTRON_LAUNCH_GRACE_S, default 60) and its exit status is returned. SIGTERM/SIGINT to this script are passed
# on the same way; after a clean preemption (every process saved and exited 0) it returns 0.
set -euo pipefail

usage() { echo "usage: $0 N [--devices D] -- [jaxtron.train arguments ...]" >&2; exit 2; }
[[ $# -ge 1 && "$1" =~ ^[0-9]+$ && "$1" -ge 1 ]] || usage
n=$1; shift
devices=$(( 8 / n )); (( devices >= 1 )) || devices=1
if [[ $# -ge 2 && "$1" == "--devices" ]]; then devices=$2; shift 2; fi
[[ $# -ge 1 && "$1" == "--" ]] && shift
python=${PYTHON:-python}
module=${JAXTRON_LAUNCH_MODULE:-jaxtron.train}
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

grace=${JAXTRON_LAUNCH_GRACE_S:-60}
pids=()
stopping=0
# Stop the children: SIGTERM (they save a checkpoint and exit), then SIGKILL whatever is left after the grace
# period (a stopped or hung child never acts on SIGTERM).
stop_children() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  # Its output goes nowhere: an orphaned `sleep` holding this script's stdout/stderr would keep a reader of
  # them (a pipe, `| tee`) waiting out the whole grace period after the script itself has exited.
  ( sleep "$grace"; for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done ) >/dev/null 2>&1 &
  killer=$!
}
on_signal() {
  (( stopping )) && return
  stopping=1
  echo "launch_local.sh: $1: asking the processes to save and stop (SIGKILL after ${grace} s)" >&2
  stop_children
}
trap 'on_signal SIGTERM' TERM
trap 'on_signal SIGINT' INT

for (( i = 0; i < n; i++ )); do
  JAX_PLATFORMS=cpu \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices" \
  JAXTRON_COORDINATOR="127.0.0.1:$port" JAXTRON_NUM_PROCESSES=$n JAXTRON_PROCESS_ID=$i \
    "$python" -m "$module" "$@" &
  pids+=($!)
done

status=0
running=("${pids[@]}")
while (( ${#running[@]} > 0 )); do
  set +e
  done_pid=""
  wait -n -p done_pid "${running[@]}"
  rc=$?
  set -e
  [[ -z "${done_pid:-}" ]] && continue  # a trapped signal interrupted the wait: no child ended
  left=()
  for p in "${running[@]}"; do [[ "$p" != "$done_pid" ]] && left+=("$p"); done
  running=("${left[@]}")
  if (( rc != 0 && status == 0 )); then
    status=$rc
    if (( ! stopping )); then
      stopping=1
      echo "launch_local.sh: process $done_pid exited with status $rc; stopping the others" >&2
      stop_children
    fi
  fi
done
[[ -n "${killer:-}" ]] && kill "$killer" 2>/dev/null || true
exit $status
