#!/usr/bin/env bash
# Start N jaxtron processes on this machine, joined into one JAX distributed run (for tests and demos).
#
#   scripts/launch_local.sh N [--devices D] -- [python -m jaxtron.train arguments ...]
#
# The machine's CPU devices are split among the processes: each gets D (default 8/N) virtual CPU devices, so
# the global mesh has N*D devices (parallel.* sizes are global). Set JAXTRON_LAUNCH_MODULE to run another
# module than jaxtron.train. If any process fails, the others are stopped and its exit status is returned.
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

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup INT TERM

for (( i = 0; i < n; i++ )); do
  JAX_PLATFORMS=cpu \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$devices" \
  JAXTRON_COORDINATOR="127.0.0.1:$port" JAXTRON_NUM_PROCESSES=$n JAXTRON_PROCESS_ID=$i \
    "$python" -m "$module" "$@" &
  pids+=($!)
done

status=0
remaining=$n
while (( remaining > 0 )); do
  set +e
  wait -n
  rc=$?
  set -e
  remaining=$(( remaining - 1 ))
  if (( rc != 0 && status == 0 )); then
    status=$rc
    echo "launch_local.sh: a process exited with status $rc; stopping the others" >&2
    cleanup
  fi
done
exit $status
