#!/usr/bin/env bash
# Print what a new user of the testbed needs: the gateway URL, a demo user's key, the capacity plan and
# the measured cold start (read from the box; nothing is re-measured), and a curl command to try.
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
export ANSIBLE_VAULT_PASSWORD_FILE="$TESTBED_CACHE/vault-pass"
report="$TESTBED_CACHE/report.txt"
.venv/bin/ansible-playbook -i inventories/testbed playbooks/cold_start.yml \
  -e "teamserve_report_file=$report" >"$TESTBED_CACHE/report.log" 2>&1 ||
  { tail -30 "$TESTBED_CACHE/report.log"; log "reading the report from the box failed (log: $TESTBED_CACHE/report.log)"; exit 1; }
echo
cat "$report"
key=$(.venv/bin/ansible-vault view inventories/testbed/group_vars/teamserve/caddy_keys.vault.yml |
      .venv/bin/python -c 'import sys,yaml; print(yaml.safe_load(sys.stdin)["caddy_user_keys"]["alice"])')
# The URL the caddy role published, as the report printed it.
url=$(sed -n 's|^Gateway URL: \([^ ]*\)/v1 .*|\1|p' "$report")
ca="$TESTBED_CACHE/caddy-root.crt"   # the box's Caddy root certificate, fetched by the caddy role
cat <<TXT

Gateway URL:  $url/v1
CA:           $ca
Demo user:    alice
Key:          $key
Try it:
  curl -N --cacert $ca $url/v1/chat/completions \\
    -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \\
    -d '{"model": "tiny", "stream": true, "max_tokens": 32, "messages": [{"role": "user", "content": "Hello"}]}'
  SSL_CERT_FILE=$ca .venv/bin/python -c 'import openai
  c = openai.OpenAI(base_url="$url/v1", api_key="$key")
  for ch in c.chat.completions.create(model="tiny", stream=True, max_tokens=32, messages=[{"role": "user", "content": "Hello"}]):
      print(ch.choices[0].delta.content or "", end="", flush=True)'
(The box's gateway answers this machine, which sits on the testbed's LAN 10.231.0.0/24 and is let
around the front gateway on purpose; other LAN hosts go through the front, below; from the outside
network 10.232.0.0/24 nothing answers.)
TXT
# The front gateway over this box and a second one (README "Several boxes"), when the scenario has it.
front_ca="$TESTBED_CACHE/front-caddy-root.crt"
if [[ -s $front_ca ]]; then
  cat <<TXT

Front gateway: https://10.231.0.30:8443/v1 (CA $front_ca), the same users and keys, balancing over
this box and teamserve-box-b (whose engine is a test double answering as model fixture-b).
TXT
fi
