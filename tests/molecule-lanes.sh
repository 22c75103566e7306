#!/usr/bin/env bash
# Run molecule scenarios in lanes and phases.
#   tests/molecule-lanes.sh default:destroy+syntax+create+converge gpu_host,caddy -- default:verify+destroy
# Each argument is a lane; lanes run side by side, the items of a lane (comma-separated) one after the
# other. A lone "--" is a barrier: every lane before it ends before the next ones start.
# An item is a scenario ("molecule test -s NAME") or NAME:ACTION+ACTION... (molecule's own commands, in
# order). When an action fails, the scenario is destroyed and its later items are skipped; other
# scenarios go on. Output: $MOLECULE_LOG_DIR/<scenario>.log; each item's seconds and result are printed as
# it ends, a failed scenario's failing tasks and log tail at the end; non-zero exit if any failed.
set -uo pipefail
log_dir=${MOLECULE_LOG_DIR:-.cache/molecule-logs}
mkdir -p "$log_dir"
rm -f "$log_dir"/*.log "$log_dir"/*.failed

run_item() {
  local item=$1 scenario=${1%%:*} action start rc=0
  local -a actions=(test)
  [[ $item == *:* ]] && IFS=+ read -r -a actions <<< "${item#*:}"
  if [ -e "$log_dir/$scenario.failed" ]; then
    echo "molecule $item: skipped (an earlier step of $scenario failed)"
    return 1
  fi
  start=$SECONDS
  for action in "${actions[@]}"; do
    echo "=== molecule $action -s $scenario ($(date -u +%T))" >> "$log_dir/$scenario.log"
    molecule "$action" -s "$scenario" >> "$log_dir/$scenario.log" 2>&1 || { rc=$?; break; }
  done
  if [ "$rc" -ne 0 ]; then
    echo "$action" > "$log_dir/$scenario.failed"
    [ "$action" = test ] || molecule destroy -s "$scenario" >> "$log_dir/$scenario.log" 2>&1
  fi
  echo "molecule $item: $((SECONDS - start)) s, $([ "$rc" -eq 0 ] && echo passed || echo "FAILED in $action (rc=$rc)")"
  return "$rc"
}

run_lane() {
  local item lane_rc=0
  for item in ${1//,/ }; do
    run_item "$item" || lane_rc=1
  done
  return "$lane_rc"
}

pids=()
for lane in "$@"; do
  if [ "$lane" = -- ]; then
    for pid in "${pids[@]}"; do wait "$pid"; done
    pids=()
    continue
  fi
  run_lane "$lane" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

failed=0
for marker in "$log_dir"/*.failed; do
  [ -e "$marker" ] || continue
  scenario=$(basename "$marker" .failed)
  failed=1
  echo "===== molecule $scenario FAILED in $(cat "$marker"): failing tasks and tests in $log_dir/$scenario.log ====="
  grep -n -A 12 -E 'fatal: \[|FAILED! =>|failed: \[|^E  |FAILED .*::| failed=[1-9]|ERROR ' "$log_dir/$scenario.log" | head -n 300
  echo "===== last 60 lines ====="
  tail -n 60 "$log_dir/$scenario.log"
done
exit "$failed"
