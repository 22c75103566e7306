#!/usr/bin/env bash
# Gateway overhead benchmark on the testbed, in ONE run: the vLLM engine directly, the Caddy gateway
# (as deployed by site.yml) and LiteLLM's proxy (from PyPI, pinned in requirements.txt) configured with
# the same users, keys, per-user limits and in-flight cap, all in front of the same engine.
#
#   benchmarks/gateway/run.sh [bench_gateway.py options, e.g. --rounds 5 --concurrency 1 16]
#
# Needs the molecule `default` box converged (`molecule converge -s default`): the engine on the box's
# 127.0.0.1:8000, Caddy on :8443. The load client and the LiteLLM proxy run on this machine INSIDE the
# box's network namespace (nsenter -n), so all three targets are loopback and comparable: only the
# network namespace is shared, the programs and files are this machine's. Secrets (the engine key, the
# user keys) come from the testbed vault, live only in a 0700 temporary directory and in the LiteLLM
# process's environment, and are removed on exit. Prints the Markdown table on stdout; progress and the
# LiteLLM log's tail (on failure) on stderr. Leaves nothing running.
set -euo pipefail
umask 077

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
TESTBED_CACHE=${TESTBED_CACHE:-/var/cache/teamserve-testbed}
BOX=${BOX:-teamserve-box}
# Users whose keys the load is spread over (round-robin), and the port LiteLLM listens on in the box.
BENCH_USERS=${BENCH_USERS:-alice bob}
LITELLM_PORT=${LITELLM_PORT:-4000}
group_vars=$repo/inventories/testbed/group_vars/teamserve
project_python=$repo/.venv/bin/python

log() { printf '[run.sh %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ -x "$project_python" ] || die "no project venv at $repo/.venv (run: make venv)"
[ -r "$TESTBED_CACHE/vault-pass" ] || die "no vault password at $TESTBED_CACHE/vault-pass (run: make testbed)"
box_pid=$(docker inspect -f '{{.State.Pid}}' "$BOX" 2>/dev/null) || die "no container $BOX (run: molecule converge -s default)"
[ "$box_pid" -gt 0 ] || die "$BOX is not running"
in_box() { nsenter -t "$box_pid" -n "$@"; }

# --- 1. LiteLLM in its own venv, keyed by the requirements file's content ----------------------------
version=$(sed -n 's/^litellm\[proxy\]==\([^ ]*\) .*/\1/p' "$here/requirements.txt")
venv=$TESTBED_CACHE/bench/litellm-$version-$(sha256sum "$here/requirements.txt" | cut -c1-12)
if [ ! -e "$venv/.installed" ]; then
  log "installing litellm[proxy]==$version into $venv (hash-checked; about 1 min, 750 MB)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --require-hashes --no-deps -r "$here/requirements.txt"
  touch "$venv/.installed"
fi
# The compromised LiteLLM releases of 2026 ran their payload from a .pth file at interpreter start.
unexpected_pth=$(find "$venv" -name '*.pth' ! -name distutils-precedence.pth)
[ -z "$unexpected_pth" ] || die "unexpected .pth file(s) in $venv: $unexpected_pth (not starting it)"

# --- 2. The same users, keys and limits as the gateway -----------------------------------------------
work=$(mktemp -d /tmp/teamserve-gateway-bench.XXXXXX)
chmod 0700 "$work"
litellm_pid=""
cleanup() {
  if [ -n "$litellm_pid" ] && kill -0 "$litellm_pid" 2>/dev/null; then
    kill "$litellm_pid" && wait "$litellm_pid" 2>/dev/null || true
  fi
  # LITELLM_LOG_COPY=<file>: keep LiteLLM's log for debugging (mode 0600: errors may quote requests).
  if [ -n "${LITELLM_LOG_COPY:-}" ] && [ -f "$work/litellm.log" ]; then cp "$work/litellm.log" "$LITELLM_LOG_COPY"; fi
  rm -rf "$work"
}
trap cleanup EXIT

"$repo/.venv/bin/ansible-vault" view --vault-password-file "$TESTBED_CACHE/vault-pass" "$group_vars/vault.yml" \
  > "$work/vault.yml"
# Writes keys.json (LiteLLM's custom auth), engine.env, bench-keys (the users' keys, comma-separated)
# and per-minute (the request budget per target). Limits: Caddy's
# events/window as requests per minute, LiteLLM's unit.
BENCH_USERS=$BENCH_USERS "$project_python" - "$group_vars/main.yml" "$work" <<'EOF'
import json, os, pathlib, re, sys
import yaml
main = yaml.safe_load(pathlib.Path(sys.argv[1]).read_text())
work = pathlib.Path(sys.argv[2])
vault = yaml.safe_load((work / "vault.yml").read_text())
keys = vault["vault_caddy_user_keys"]
seconds = {"s": 1, "m": 60, "h": 3600, "d": 86400}
users = []
for user in main["caddy_users"]:
    if user["name"] not in keys:
        continue  # no key: no access through Caddy either
    count, unit = re.fullmatch(r"([1-9][0-9]*)([smhd])", user["rate_limit"]["window"]).groups()
    rpm = max(1, user["rate_limit"]["events"] * 60 // (int(count) * seconds[unit]))
    users.append({"name": user["name"], "key": keys[user["name"]], "rpm": rpm})
(work / "keys.json").write_text(json.dumps({"users": users}))
(work / "engine.env").write_text(vault["vault_vllm_api_key"])
chosen = os.environ["BENCH_USERS"].split()
missing = [n for n in chosen if n not in keys]
if missing:
    sys.exit(f"BENCH_USERS: {missing} have no key in the testbed vault")
(work / "bench-keys").write_text(",".join(keys[n] for n in chosen))
# Half the chosen users' joint budget: the run does not meet the limiter, and leaves the other half to
# whoever else tests with these users on the shared box at the same time (seen: 53 requests a minute).
rpm = {u["name"]: u["rpm"] for u in users}
(work / "per-minute").write_text(str(sum(rpm[n] for n in chosen) // 2))
print(", ".join(f"{u['name']} {u['rpm']}/min" for u in users), file=sys.stderr)
EOF
rm -f "$work/vault.yml"
# The gateway's in-flight cap is derived from the engine's plan (roles/caddy: max-num-seqs +
# max-num-queued-reqs): read both from the running engine's command line.
engine_flag() {
  docker exec "$BOX" docker inspect -f '{{json .Config.Cmd}}' vllm \
    | "$project_python" -c 'import json,sys; a=json.load(sys.stdin); print(a[a.index(sys.argv[1]) + 1])' "$1"
}
inflight=$(( $(engine_flag --max-num-seqs) + $(engine_flag --max-num-queued-reqs) ))

# --- 3. LiteLLM: TLS like the gateway (a throw-away self-signed P-256 certificate for localhost) -------
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=localhost \
  -addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout "$work/litellm.key" -out "$work/litellm.crt" 2>/dev/null
cp "$here/litellm_auth.py" "$work/"
# global_max_parallel_requests = the gateway's derived in-flight cap: the same "server full" cap (LiteLLM answers 429 past it,
# Caddy 503). In 1.108.7 only the legacy limiter reads it: the default one (proxy/hooks/__init__.py maps
# "parallel_request_limiter" to parallel_request_limiter_v3, which never looks at the setting) ignores it
# silently; LEGACY_MULTI_INSTANCE_RATE_LIMITING=true selects the legacy one (parallel_request_limiter.py),
# which enforces it and the per-key rpm_limit. num_retries 0: a refused request is answered, not retried
# (Caddy does not retry either).
cap_line=""
[ "$inflight" -eq 0 ] || cap_line="  global_max_parallel_requests: $inflight"
cat > "$work/config.yaml" <<EOF
model_list:
  - model_name: tiny
    litellm_params:
      model: hosted_vllm/tiny
      api_base: http://127.0.0.1:8000/v1
      api_key: os.environ/TEAMSERVE_ENGINE_KEY
general_settings:
  master_key: os.environ/LITELLM_MASTER_KEY
  custom_auth: litellm_auth.user_api_key_auth
$cap_line
litellm_settings:
  num_retries: 0
  request_timeout: 600
router_settings:
  num_retries: 0
EOF
log "starting LiteLLM $version in $BOX's network namespace on 127.0.0.1:$LITELLM_PORT (in-flight cap $inflight)"
# Secrets go through the environment (readable by root only), not the command line (readable by all).
(
  TEAMSERVE_ENGINE_KEY=$(cat "$work/engine.env") LITELLM_MASTER_KEY="sk-$(openssl rand -hex 24)"
  export TEAMSERVE_ENGINE_KEY LITELLM_MASTER_KEY TEAMSERVE_LITELLM_KEYS_FILE="$work/keys.json" \
    LITELLM_LOCAL_MODEL_COST_MAP=True LITELLM_LOG=ERROR LEGACY_MULTI_INSTANCE_RATE_LIMITING=true
  exec nsenter -t "$box_pid" -n "$venv/bin/litellm" --config "$work/config.yaml" --host 127.0.0.1 \
    --port "$LITELLM_PORT" --ssl_keyfile_path "$work/litellm.key" --ssl_certfile_path "$work/litellm.crt"
) > "$work/litellm.log" 2>&1 &
# The subshell execs nsenter, which (-n only, no --fork) execs LiteLLM: $! is LiteLLM's own PID.
litellm_pid=$!
for _ in $(seq 120); do
  if in_box curl -sf -o /dev/null --cacert "$work/litellm.crt" "https://localhost:$LITELLM_PORT/health/liveliness"; then
    break
  fi
  kill -0 "$litellm_pid" 2>/dev/null || { tail -20 "$work/litellm.log" >&2; die "LiteLLM exited"; }
  sleep 1
done
in_box curl -sf -o /dev/null --cacert "$work/litellm.crt" "https://localhost:$LITELLM_PORT/health/liveliness" \
  || { tail -20 "$work/litellm.log" >&2; die "LiteLLM did not answer within 120 s"; }

# Both gateways really authenticate: an unknown key is refused with 401 before anything is measured.
for target in "https://localhost:8443/v1/models $TESTBED_CACHE/caddy-root.crt" \
              "https://localhost:$LITELLM_PORT/v1/models $work/litellm.crt"; do
  set -- $target "$@"
  status=$(in_box curl -s -o /dev/null -w '%{http_code}' --cacert "$2" \
    -H "Authorization: Bearer sk-unknown-$(openssl rand -hex 16)" "$1" || true)
  [ "$status" = 401 ] || { tail -30 "$work/litellm.log" >&2; die "$1 answered ${status:-nothing} to an unknown key, not 401"; }
  shift 2
done

# --- 4. The run ---------------------------------------------------------------------------------
# The engine is shared: someone may be restarting it. Wait (at most 10 min) until it is healthy.
for _ in $(seq 120); do
  in_box curl -sf -o /dev/null http://127.0.0.1:8000/health && break
  log "waiting for the engine's /health"
  sleep 5
done
engine_started() { docker exec "$BOX" docker inspect -f '{{.State.StartedAt}}' vllm; }
started=$(engine_started)
# ignore_eos (a vLLM sampling parameter): every stream generates exactly --max-tokens tokens.
log "engine $(in_box curl -s http://127.0.0.1:8000/version) (started $started), Caddy on :8443, LiteLLM on :$LITELLM_PORT; users: $BENCH_USERS"
in_box python3 "$here/bench_gateway.py" \
  --target "direct=http://127.0.0.1:8000/v1,@$work/engine.env" \
  --target "caddy=https://localhost:8443/v1,@$work/bench-keys" \
  --target "litellm=https://localhost:$LITELLM_PORT/v1,@$work/bench-keys" \
  --cafile "$TESTBED_CACHE/caddy-root.crt" --cafile "$work/litellm.crt" \
  --model tiny --per-minute "$(cat "$work/per-minute")" --extra-body '{"ignore_eos": true}' "$@" > "$work/table.md"
# A run the engine was restarted in (the box is shared) is not a result.
[ "$(engine_started)" = "$started" ] || die "the engine was restarted during the run (not a result): run again"
cat "$work/table.md"
