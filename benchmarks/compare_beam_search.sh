#!/usr/bin/env bash
# Offline beam-search throughput of aserve (`aserve bench throughput --beam-width`) and vLLM's CPU build
# (LLM.beam_search, benchmarks/vllm_beam_search.py) on one workload, one after the other in one run, and their ratio.
# Usage: [DTYPE=float32|bfloat16] benchmarks/compare_beam_search.sh MODEL_DIR [NUM_PROMPTS] [INPUT_LEN] [OUTPUT_LEN] [BEAM_WIDTH]
# Needs `aserve` on PATH and benchmarks/setup_vllm_cpu.sh run once. Run it on a quiet machine.
set -uo pipefail
model=$1 n=${2:-32} inlen=${3:-128} outlen=${4:-128} width=${5:-4}
source "$(dirname "$0")/peer_env.sh"
figure() { grep -oE 'Throughput: .*output tokens/s' | tail -1; }
aserve_out=$(aserve bench throughput --model "$model" --num-prompts "$n" --input-len "$inlen" --output-len "$outlen" \
  --beam-width "$width" --dtype "$DTYPE" 2>&1)
grep 'KV blocks at the peak' <<<"$aserve_out"
a=$(figure <<<"$aserve_out")
v=$("$VLLM_VENV/bin/python" "$(dirname "$0")/vllm_beam_search.py" "$model" "$n" "$inlen" "$outlen" "$width" "$DTYPE" 2>&1 | figure)
echo "aserve: $a"
echo "vllm:   $v"
ao=$(sed -E 's/.* ([0-9.]+) output tokens\/s/\1/' <<<"$a"); vo=$(sed -E 's/.* ([0-9.]+) output tokens\/s/\1/' <<<"$v")
[[ -n $ao && -n $vo ]] && python3 -c "print(f'output tokens/s ratio aserve/vllm = {$ao/$vo:.2f}')"
