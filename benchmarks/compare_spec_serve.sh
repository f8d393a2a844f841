#!/usr/bin/env bash
# Served throughput with and without speculative decoding on one workload: two aserve servers on 127.0.0.1 (the
# same model, one with SPEC_JSON), measured by `aserve bench serve` in alternating rounds, so that a slow spell of
# the machine hits both; prints each round's output tokens/s, the acceptance figures, and the ratio over all rounds.
# Each round sends new prompts (--seed), the same to both servers, so that neither finds them in its prefix cache.
# Usage: [DTYPE=auto] [ROUNDS=2] benchmarks/compare_spec_serve.sh MODEL_DIR SPEC_JSON [NUM_PROMPTS] [INPUT_LEN]
#        [OUTPUT_LEN] [PROMPT_REPEATS] [TEMPERATURE]
# e.g. benchmarks/compare_spec_serve.sh /tmp/bench-model '{"method": "ngram", "num_speculative_tokens": 4}' 1 512 256 4 0
# Run it on a quiet machine: a busy server spins on both cores (an idle one waits).
set -uo pipefail
model=$1 spec=$2 n=${3:-1} inlen=${4:-512} outlen=${5:-256} repeats=${6:-4} temp=${7:-0}
dtype=${DTYPE:-auto} rounds=${ROUNDS:-2}
logs=${LOG_DIR:-${TMPDIR:-/tmp}}
port=${PORT:-18200}
plain=http://127.0.0.1:$port specurl=http://127.0.0.1:$((port + 1))

wait_healthy() { for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
aserve serve --model "$model" --dtype "$dtype" --host 127.0.0.1 --port "$port" > "$logs/spec_serve_plain.log" 2>&1 &
pids=$!
aserve serve --model "$model" --dtype "$dtype" --host 127.0.0.1 --port $((port + 1)) --speculative-config "$spec" \
  > "$logs/spec_serve_spec.log" 2>&1 &
pids="$pids $!"
trap 'kill -INT $pids 2>/dev/null; wait' EXIT
wait_healthy "$plain" && wait_healthy "$specurl" || { echo "a server did not start: see $logs/spec_serve_*.log"; exit 1; }
bench() {  # URL NAME SEED
  aserve bench serve --base-url "$1" --num-prompts "$n" --input-len "$inlen" --output-len "$outlen" \
    --prompt-repeats "$repeats" --temperature "$temp" --seed "$3" --json "$logs/spec_serve_$2.json" 2>&1
}
bench "$plain" warm 0 >/dev/null; bench "$specurl" warm 0 >/dev/null
total_plain=0 total_spec=0
for round in $(seq "$rounds"); do
  for which in plain spec; do
    url=$plain; [ "$which" = spec ] && url=$specurl
    out=$(bench "$url" "$which" "$round")
    [ "$round" = 1 ] && echo "$out" | head -1
    rate=$(echo "$out" | awk -F: '/Output token throughput/ {gsub(/ /, "", $2); print $2}')
    echo "round $round, $which: output tokens/s $rate"
    echo "$out" | grep -E "Acceptance rate|Mean acceptance length|Median TPOT"
    if [ "$which" = plain ]; then total_plain=$(awk "BEGIN {print $total_plain + $rate}")
    else total_spec=$(awk "BEGIN {print $total_spec + $rate}"); fi
  done
done
echo "output tokens/s ratio with/without speculation = $(awk "BEGIN {printf \"%.2f\", $total_spec / $total_plain}")" \
  "($rounds alternating rounds)"
