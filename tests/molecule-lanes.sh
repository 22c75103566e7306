#!/usr/bin/env bash
# Run molecule scenarios in parallel lanes: each argument is a lane, its scenarios separated by commas
# and run one after the other (a failure does not stop the lane); the lanes run side by side.
#   tests/molecule-lanes.sh default gpu_host,caddy,firewall
# Each scenario's output goes to $MOLECULE_LOG_DIR/<scenario>.log; its seconds and result are printed as
# it ends, a failed scenario's log tail is shown at the end, and the exit status is non-zero if any failed.
# MOLECULE_CMD is the command a scenario name is appended to (default "molecule test -s").
set -uo pipefail
log_dir=${MOLECULE_LOG_DIR:-.cache/molecule-logs}
read -r -a cmd <<< "${MOLECULE_CMD:-molecule test -s}"
mkdir -p "$log_dir"
rm -f "$log_dir"/*.log "$log_dir"/*.status

run_lane() {
  local scenario start rc lane_rc=0
  for scenario in ${1//,/ }; do
    start=$SECONDS
    "${cmd[@]}" "$scenario" > "$log_dir/$scenario.log" 2>&1
    rc=$?
    echo "$rc $((SECONDS - start))" > "$log_dir/$scenario.status"
    echo "molecule $scenario: $((SECONDS - start)) s, $([ "$rc" -eq 0 ] && echo passed || echo "FAILED (rc=$rc)")"
    [ "$rc" -eq 0 ] || lane_rc=$rc
  done
  return "$lane_rc"
}

pids=()
for lane in "$@"; do
  run_lane "$lane" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

failed=0
for lane in "$@"; do
  for scenario in ${lane//,/ }; do
    if [ ! -e "$log_dir/$scenario.status" ]; then
      echo "molecule $scenario: no result"
      failed=1
    elif [ "$(cut -d' ' -f1 "$log_dir/$scenario.status")" != 0 ]; then
      echo "===== molecule $scenario FAILED: last 150 lines of $log_dir/$scenario.log ====="
      tail -n 150 "$log_dir/$scenario.log"
      failed=1
    fi
  done
done
exit "$failed"
