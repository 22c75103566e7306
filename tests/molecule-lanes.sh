#!/usr/bin/env bash
# Run molecule scenarios in lanes and phases.
#   tests/molecule-lanes.sh default:destroy+syntax+create+converge gpu_host,caddy -- default:verify+destroy
# Each argument is a lane; lanes run side by side, the items of a lane (comma-separated) one after the
# other. A lone "--" is a barrier: every lane before it ends before the next ones start.
# An item is a scenario ("molecule test -s NAME") or NAME:ACTION+ACTION... (molecule's own commands, in
# order); make:TARGET+TARGET runs those Makefile targets side by side (make -j2), logged as "make". When
# an action fails, the scenario is destroyed and its later items are skipped; other scenarios go on.
# Output: $MOLECULE_LOG_DIR/<scenario>.log; each item's seconds and result are printed as it ends; at the
# end a failed scenario's log tail, then its failing tasks and tests (CI keeps the last lines); non-zero
# exit if any failed.
# The lanes beside a phase's first lane run at low priority: LANES_NICE (10) for their controller,
# LANES_CPU_SHARES (128, Docker's --cpu-shares) for their boxes.
# `tests/molecule-lanes.sh --summary` prints that end again from the logs of the last run (make test puts it
# after lint's and unit's output).
set -uo pipefail
log_dir=${MOLECULE_LOG_DIR:-.cache/molecule-logs}
export COLUMNS=${COLUMNS:-200} # molecule and pytest wrap at the terminal width; wide lines grep whole

# CI shows only the end of the output: the log tails first, the failing tasks and tests, then a few lines
# per failed scenario (verify.yml's FAIL rows, the failed tasks' messages, the failed tests) last.
plain() { sed -e 's/\x1b\[[0-9;]*m//g' -e 's/^ *│ *//' "$@"; }
summary() {
  local marker scenario
  local -a failed=()
  for marker in "$log_dir"/*.failed; do
    [ -e "$marker" ] || continue
    failed+=("$(basename "$marker" .failed)")
  done
  for scenario in "${failed[@]}"; do
    echo "===== molecule $scenario: last 40 lines of $log_dir/$scenario.log ====="
    plain "$log_dir/$scenario.log" | tail -n 40
  done
  for scenario in "${failed[@]}"; do
    echo "===== molecule $scenario FAILED in $(cat "$log_dir/$scenario.failed"): failing tasks and tests ====="
    plain "$log_dir/$scenario.log" | grep -A 8 -E 'fatal: \[|failed: \[|^E  ' | cut -c1-200 | head -n 120
    plain "$log_dir/$scenario.log" | grep -v 'FAILED - RETRYING' | grep -E '^(FAILED|ERROR) |^=+ .*(failed|error)' | cut -c1-300
  done
  for scenario in "${failed[@]}"; do
    echo "===== molecule $scenario FAILED in $(cat "$log_dir/$scenario.failed"), in brief ====="
    {
      plain "$log_dir/$scenario.log" | grep -E "^ *- '? ?[0-9]+ .* FAIL "
      plain "$log_dir/$scenario.log" | grep -A 3 -E 'fatal: \[|failed: \[' | grep -E '^ *msg: '
      plain "$log_dir/$scenario.log" | grep -E '^FAILED ' | grep -v 'FAILED - RETRYING'
    } | cut -c1-240 | tail -n 12
  done
  [ "${#failed[@]}" -eq 0 ] || echo "molecule: FAILED: ${failed[*]}"
  [ "${#failed[@]}" -eq 0 ]
}
if [ "${1:-}" = --summary ]; then
  summary
  exit
fi

mkdir -p "$log_dir"
rm -f "$log_dir"/*.log "$log_dir"/*.failed
rm -rf "$log_dir"/default-playbooks # the playbook runs of the default scenario's tests (its conftest.py)

run_item() {
  local item=$1 scenario=${1%%:*} action start rc=0
  local -a actions=(test)
  [[ $item == *:* ]] && IFS=+ read -r -a actions <<< "${item#*:}"
  if [ -e "$log_dir/$scenario.failed" ]; then
    echo "molecule $item: skipped (an earlier step of $scenario failed)"
    return 1
  fi
  start=$SECONDS
  if [ "$scenario" = make ]; then
    action=${actions[*]}
    echo "=== make ${actions[*]} ($(date -u +%T))" >> "$log_dir/make.log"
    make --no-print-directory -j2 --output-sync=target "${actions[@]}" >> "$log_dir/make.log" 2>&1 || rc=$?
    [ "$rc" -eq 0 ] || echo "$action" > "$log_dir/make.failed"
  else
    for action in "${actions[@]}"; do
      echo "=== molecule $action -s $scenario ($(date -u +%T))" >> "$log_dir/$scenario.log"
      molecule "$action" -s "$scenario" >> "$log_dir/$scenario.log" 2>&1 || { rc=$?; break; }
    done
    if [ "$rc" -ne 0 ]; then
      echo "$action" > "$log_dir/$scenario.failed"
      [ "$action" = test ] || molecule destroy -s "$scenario" >> "$log_dir/$scenario.log" 2>&1
    fi
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

# A scenario's boxes (the platforms of its molecule.yml).
boxes() {
  python3 -c 'import sys, yaml; print(*[p["name"] for p in yaml.safe_load(open(sys.argv[1]))["platforms"]])' \
    "molecule/$1/molecule.yml"
}

# Holds the boxes of a lane's scenarios at CPU weight $LANES_CPU_SHARES (Docker's --cpu-shares; its
# default is 1024) as they are created and re-created, while the process $2 (the lane) runs; then puts
# those still there back to 1024, so a box a later phase uses is not left behind.
weigh_boxes() {
  local item lane=$2 scenario_boxes=() names=() name shares
  for item in ${1//,/ }; do
    [ "${item%%:*}" = make ] && continue
    read -r -a scenario_boxes <<< "$(boxes "${item%%:*}")"
    names+=("${scenario_boxes[@]}")
  done
  [ "${#names[@]}" -gt 0 ] || return 0
  while kill -0 "$lane" 2> /dev/null && sleep 2; do
    # One inspect for all of them; 0 is Docker's default (not weighed yet), a box not there prints nothing.
    docker inspect --format '{{.Name}} {{.HostConfig.CpuShares}}' "${names[@]}" 2> /dev/null |
      while read -r name shares; do
        [ "$shares" = 0 ] && docker update --cpu-shares "$LANES_CPU_SHARES" "${name#/}" > /dev/null 2>&1
      done
  done
  docker inspect --format '{{.Name}}' "${names[@]}" 2> /dev/null | while read -r name; do
    docker update --cpu-shares 1024 "${name#/}" > /dev/null 2>&1
  done
  return 0
}

# The first lane of a phase is the long one the phase waits for, and holds its timed checks. The lanes
# beside it run at low priority, so on 2 cores they take the CPU it leaves idle (engine starts, timed
# waits) instead of half of it: their controller at nice 10, and their boxes, where each task's module
# runs, at CPU weight 128 against the first lane's 1024 (its engine's is vllm_cpu_shares, 256).
LANES_CPU_SHARES=${LANES_CPU_SHARES:-128}
pids=()
for lane in "$@"; do
  if [ "$lane" = -- ]; then
    for pid in "${pids[@]}"; do wait "$pid"; done
    pids=()
    continue
  fi
  if [ "${#pids[@]}" -eq 0 ]; then
    run_lane "$lane" &
  else
    (
      renice -n "${LANES_NICE:-10}" -p "$BASHPID" > /dev/null
      weigh_boxes "$lane" "$BASHPID" &
      run_lane "$lane"
    ) &
  fi
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

summary
