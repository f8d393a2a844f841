#!/usr/bin/env bash
# Served embedding throughput of aserve and vLLM's CPU build on one workload: each server, one at a time on
# 127.0.0.1, gets the same random prompts (token ids) from `aserve bench embed --base-url`, one prompt a
# /v1/embeddings request, CONCURRENCY clients at once.
# Usage: [DTYPE=bfloat16|float32] benchmarks/compare_embed_serve.sh MODEL_DIR [NUM_PROMPTS] [CONCURRENCY]
# Needs `aserve` on PATH and vLLM's CPU build from benchmarks/setup_vllm_cpu.sh (VLLM_VENV). Run it on a quiet
# machine: both servers spin on both cores.
set -uo pipefail
model=$1 n=${2:-512} clients=${3:-32}
source "$(dirname "$0")/peer_env.sh"
logs=${LOG_DIR:-${TMPDIR:-/tmp}}
port=${PORT:-18100}
url=http://127.0.0.1:$port

wait_healthy() { for _ in $(seq 600); do curl -sf "$url/health" >/dev/null && return 0; sleep 1; done; return 1; }
measure() {
  echo "== $1"
  aserve bench embed --base-url "$url" --model "$model" --num-prompts "$n" --concurrency "$clients" 2>&1 | grep served
}

aserve serve --model "$model" --runner pooling --dtype "$DTYPE" --host 127.0.0.1 --port "$port" \
  > "$logs/compare_embed_serve_aserve.log" 2>&1 &
pid=$!
wait_healthy && measure aserve
kill -INT $pid; wait $pid
"$VLLM_VENV/bin/vllm" serve "$model" --runner pooling --host 127.0.0.1 --port "$port" --dtype "$DTYPE" \
  > "$logs/compare_embed_serve_vllm.log" 2>&1 &
pid=$!
wait_healthy && measure vLLM || tail -20 "$logs/compare_embed_serve_vllm.log"
kill -INT $pid; sleep 5; kill -9 $pid 2>/dev/null; wait
