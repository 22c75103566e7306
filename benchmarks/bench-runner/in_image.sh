#!/bin/sh
# Runs INSIDE the engine image (see README.md): three small `vllm bench serve` runs (1, 2 and 4 concurrent)
# against the gateway tests' OpenAI test double on the container's loopback, first as three commands through
# bench_sampler.py (one per step, as a container per step ran them), then as three requests to one
# bench_runner.py. Prints each way's wall time. No network: everything is on 127.0.0.1 in the container.
set -eu
tools=/w/roles/teamserve_verify/files
out=$(mktemp -d)
export OPENAI_API_KEY=bench-runner-measure HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
FIXTURE_LISTEN=127.0.0.1:18000 FIXTURE_API_KEY=$OPENAI_API_KEY FIXTURE_TOKEN_DELAY_S=0.001 FIXTURE_MODEL=tiny \
  python3 /w/tests/gateway/fake_openai_upstream.py >/dev/null 2>&1 &
# a /metrics page with the gauges the sampler keeps
mkdir -p "$out/www" && printf 'vllm:kv_cache_usage_perc{engine="0"} 0.01\nvllm:num_requests_waiting{engine="0"} 0\n' > "$out/www/metrics"
python3 -m http.server 18001 --bind 127.0.0.1 --directory "$out/www" >/dev/null 2>&1 &
sleep 2
args() { # concurrency, stem
  echo --backend=openai-chat --base-url=http://127.0.0.1:18000 --endpoint=/v1/chat/completions --model=tiny \
    --tokenizer="${TOKENIZER:-/opt/models/teamserve-tiny}" --dataset-name=random --random-input-len=32 \
    --random-output-len=8 --num-prompts=8 --max-concurrency="$1" --seed="$1" --disable-tqdm --save-result \
    --result-dir="$out" --result-filename="$2.json"
}
start=$(date +%s%N)
for c in 1 2 4; do
  # shellcheck disable=SC2046 # one word per argument
  python3 "$tools/bench_sampler.py" --metrics-url http://127.0.0.1:18001/metrics --interval 0.5 \
    --keep vllm:kv_cache_usage_perc --output "$out/cmd-c$c.samples.json" -- vllm bench serve $(args "$c" "cmd-c$c") >/dev/null 2>&1
done
end=$(date +%s%N)
echo "one vllm bench serve command per step (1, 2, 4): $(( (end - start) / 1000000 )) ms"
mkdir "$out/spool"
start=$(date +%s%N)
python3 "$tools/bench_runner.py" --spool "$out/spool" --metrics-url http://127.0.0.1:18001/metrics --interval 0.5 \
  --keep vllm:kv_cache_usage_perc >"$out/runner.log" 2>&1 &
for c in 1 2 4; do
  python3 - "$out" "$c" $(args "$c" "run-c$c") <<'PY'
import json, os, sys
out, c, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
tmp = f"{out}/spool/.run-c{c}.tmp"
with open(tmp, "w") as f:
    json.dump({"argv": argv, "output": f"{out}/run-c{c}.samples.json"}, f)
os.replace(tmp, f"{out}/spool/run-c{c}.request.json")
PY
  while [ ! -e "$out/spool/run-c$c.done" ]; do sleep 0.1; done
  cat "$out/spool/run-c$c.done"; echo
done
end=$(date +%s%N)
touch "$out/spool/stop"
echo "one bench_runner.py for the three steps: $(( (end - start) / 1000000 )) ms"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
for way in ("cmd", "run"):
    for c in (1, 2, 4):
        r = json.load(open(f"{out}/{way}-c{c}.json"))
        s = json.load(open(f"{out}/{way}-c{c}.samples.json"))
        print(f"{way} c{c}: completed {r['completed']}/{r['num_prompts']}, TTFT median {r['median_ttft_ms']:.1f} ms, "
              f"samples {len(s['samples'])}, exit {s['exit_code']}")
PY
