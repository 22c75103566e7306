#!/usr/bin/env bash
# The gateway's OWN cost, without an engine: the project's Caddy gateway (the caddy role's template,
# rendered with 20 and with 200 users) vs plain Caddy (the same binary, reverse_proxy only) vs the upstream
# directly, all in front of the same fast fake upstream (tests/gateway/fake_openai_upstream.py, one chunk
# every FIXTURE_TOKEN_DELAY_S seconds), interleaved in ONE run of bench_gateway.py at 1, 16 and 64 streams.
#
#   benchmarks/gateway/run_fake_upstream.sh [bench_gateway.py options, e.g. --rounds 5]
#
# Needs the project venv (make venv) and the Caddy binary the caddy role built on this controller
# (~/.cache/teamserve/caddy/caddy-*-gateway-*-amd64, e.g. after `molecule converge -s caddy`; CADDY=<path>
# picks another). Everything listens on 127.0.0.1 ports 18000 and 18443-18445 and is stopped on exit.
# The first target (plain Caddy) is the baseline of the "added" columns. Prints the Markdown table, then
# each Caddy's CPU time per stream. CADDY_CPUS=1 CLIENT_CPUS=0 pin the three Caddy processes and the
# client + fake upstream to different cores (taskset), so the client's scheduling does not land in the
# gateways' TTFT.
set -euo pipefail
umask 077

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv_bin=$repo/.venv/bin
TOKEN_DELAY=${FIXTURE_TOKEN_DELAY_S:-0.02}
log() { printf '[run_fake_upstream.sh %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ -x "$venv_bin/ansible-playbook" ] || die "no project venv at $repo/.venv (run: make venv)"
for arg in "$@"; do
  [ "$arg" != --json ] || die "--json is this script's own (the streams file is kept in the work folder with KEEP_WORK=1)"
done
if [ -z "${CADDY:-}" ]; then
  CADDY=$(ls -t "$HOME"/.cache/teamserve/caddy/caddy-*-gateway-*-amd64 2>/dev/null | head -1 || true)
fi
[ -n "$CADDY" ] && [ -x "$CADDY" ] || die "no Caddy build with the gateway's modules (run: molecule converge -s caddy, or set CADDY)"
# Read the list once: `list-modules | grep -q` under pipefail fails when grep exits early (SIGPIPE).
modules=$("$CADDY" list-modules)
for module in http.handlers.api_key_map http.handlers.inflight_limit; do
  grep -qx "$module" <<<"$modules" || die "$CADDY lacks $module"
done

work=$(mktemp -d /tmp/teamserve-gateway-fake-bench.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ -n "${KEEP_WORK:-}" ] || rm -rf "$work"  # KEEP_WORK=1 keeps the rendered files and logs
  true
}
trap cleanup EXIT

# --- 1. The fake upstream ----------------------------------------------------------------------------
openssl rand -hex 24 > "$work/engine-key"
FIXTURE_API_KEY=$(cat "$work/engine-key") FIXTURE_LISTEN=127.0.0.1:18000 FIXTURE_TOKEN_DELAY_S=$TOKEN_DELAY \
  ${CLIENT_CPUS:+taskset -c "$CLIENT_CPUS"} python3 "$repo/tests/gateway/fake_openai_upstream.py" > "$work/upstream.log" 2>&1 &
pids+=($!)

# --- 2. Users, keys and the project's Caddyfiles (the role's own template and defaults) --------------
# 200 users over 4 distinct rate limits of BENCH_EVENTS (default 1000) per minute, high enough never to
# refuse here; the plan gives max-num-seqs 64, so each user may have 16 in flight (64 streams over 20
# users: at most 4 per user).
"$venv_bin/python" - "$work" <<'EOF'
import json, os, pathlib, secrets, sys
work = pathlib.Path(sys.argv[1])
engine_key = (work / "engine-key").read_text().strip()
users = [{"name": f"user{i:03d}", "rate_limit": {"events": int(os.environ.get("BENCH_EVENTS", "1000")) + i % 4, "window": "1m"}} for i in range(200)]
keys = {u["name"]: secrets.token_urlsafe(36) for u in users}
hosts = {}
for count, port in ((20, 18443), (200, 18444)):
    chosen = users[:count]
    (work / f"keys-{count}").write_text(",".join(keys[u["name"]] for u in chosen))
    # bench_caddy: the role's inputs for this gateway (task vars in render.yml, above the role's defaults).
    hosts[f"gw{count}"] = {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        "vllm_plan": {"flags": {"max-num-seqs": 64, "max-num-queued-reqs": 64, "max-model-len": 8192}},
        "bench_caddy": {
            "caddy_users": chosen, "caddy_user_keys": {u["name"]: keys[u["name"]] for u in chosen},
            "caddy_tls_mode": "off", "caddy_listen_port": port, "caddy_upstream": "127.0.0.1:18000",
            "caddy_upstream_api_key": engine_key, "caddy_log_dir": str(work / f"log-{count}"),
            "caddy_admin_socket": str(work / f"admin-{count}.sock"),
        },
    }
(work / "inventory.yml").write_text(json.dumps({"all": {"hosts": hosts}}))
EOF
cat > "$work/render.yml" <<EOF
- hosts: all
  gather_facts: false
  vars_files: ["$repo/roles/caddy/defaults/main.yml", "$repo/roles/caddy/vars/main.yml"]
  tasks:
    - ansible.builtin.file: {path: "{{ bench_caddy.caddy_log_dir }}", state: directory, mode: "0700"}
    - ansible.builtin.template: {src: "$repo/roles/caddy/templates/Caddyfile.j2", dest: "$work/{{ inventory_hostname }}.Caddyfile", mode: "0600"}
      vars:
        caddy_users: "{{ bench_caddy.caddy_users }}"
        caddy_user_keys: "{{ bench_caddy.caddy_user_keys }}"
        caddy_tls_mode: "{{ bench_caddy.caddy_tls_mode }}"
        caddy_listen_port: "{{ bench_caddy.caddy_listen_port }}"
        caddy_upstream: "{{ bench_caddy.caddy_upstream }}"
        caddy_upstream_api_key: "{{ bench_caddy.caddy_upstream_api_key }}"
        caddy_log_dir: "{{ bench_caddy.caddy_log_dir }}"
        caddy_admin_socket: "{{ bench_caddy.caddy_admin_socket }}"
EOF
ANSIBLE_FILTER_PLUGINS=$repo/roles/caddy/filter_plugins "$venv_bin/ansible-playbook" -i "$work/inventory.yml" \
  "$work/render.yml" > "$work/render.log" 2>&1 || { tail -30 "$work/render.log" >&2; die "rendering failed"; }

cat > "$work/plain.Caddyfile" <<EOF
{
	admin off
	servers {
		protocols h1 h2
	}
}
http://127.0.0.1:18445 {
	reverse_proxy 127.0.0.1:18000 {
		header_up Authorization "Bearer $(cat "$work/engine-key")"
		flush_interval -1
	}
}
EOF

declare -A caddy_pid
for name in gw20 gw200 plain; do
  XDG_DATA_HOME=$work/data-$name XDG_CONFIG_HOME=$work/config-$name \
    ${CADDY_CPUS:+taskset -c "$CADDY_CPUS"} "$CADDY" run --adapter caddyfile --config "$work/$name.Caddyfile" > "$work/$name.log" 2>&1 &
  pids+=($!)
  caddy_pid[$name]=$!
done
# CPU seconds (user + system) a process has used so far, from /proc/PID/stat fields 14 and 15.
cpu_seconds() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.2f", ($14 + $15) / hz}' "/proc/$1/stat"; }
for port in 18000 18443 18444 18445; do
  for _ in $(seq 50); do
    curl -s -o /dev/null "http://127.0.0.1:$port/health" && break
    sleep 0.2
  done
  curl -s -o /dev/null "http://127.0.0.1:$port/health" || die "nothing answers on 127.0.0.1:$port"
done
status=$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer not-a-key" http://127.0.0.1:18443/v1/models)
[ "$status" = 401 ] || die "the project's gateway answered $status to an unknown key, not 401"

# --- 3. The run ----------------------------------------------------------------------------------
log "Caddy $("$CADDY" version | cut -d' ' -f1), upstream chunk every ${TOKEN_DELAY}s; plain Caddy is the baseline"
declare -A cpu_before
for name in plain gw20 gw200; do cpu_before[$name]=$(cpu_seconds "${caddy_pid[$name]}"); done
${CLIENT_CPUS:+taskset -c "$CLIENT_CPUS"} python3 "$here/bench_gateway.py" --json "$work/streams.json" \
  --target "plain-caddy=http://127.0.0.1:18445/v1,@$work/engine-key" \
  --target "direct=http://127.0.0.1:18000/v1,@$work/engine-key" \
  --target "gateway-20-users=http://127.0.0.1:18443/v1,@$work/keys-20" \
  --target "gateway-200-users=http://127.0.0.1:18444/v1,@$work/keys-200" \
  --model fixture --concurrency 1 16 64 --pause 0.5 "$@"

# Each Caddy served the same streams (the run interleaves the targets), so the CPU time each used during
# the run compares the gateway's own work per stream with plain Caddy's, free of the client's and the
# upstream's scheduling noise. Warm-up streams count; startup does not.
streams=$(python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print(sum(len(b["streams"]) for level in d["raw"].values() for b in level["plain-caddy"]) + d["args"]["warmup"])' "$work/streams.json")
echo
echo "| Caddy | streams | CPU seconds during the run | CPU ms per stream | added ms per stream |"
echo "| --- | ---: | ---: | ---: | ---: |"
for name in plain gw20 gw200; do
  used=$(awk -v a="${cpu_before[$name]}" -v b="$(cpu_seconds "${caddy_pid[$name]}")" 'BEGIN {printf "%.2f", b - a}')
  [ "$name" = plain ] && plain_used=$used
  awk -v n="$name" -v s="$streams" -v u="$used" -v p="$plain_used" \
    'BEGIN {printf "| %s | %d | %.2f | %.2f | %s |\n", n, s, u, 1000 * u / s, n == "plain" ? "—" : sprintf("%+.2f", 1000 * (u - p) / s)}'
done
