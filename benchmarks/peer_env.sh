# Sourced by the comparison scripts: the dtype both engines get, the CPU line every figure carries, and vLLM's settings.
# DTYPE defaults to bfloat16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), else float32.
if [[ -z ${DTYPE:-} ]]; then grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && DTYPE=bfloat16 || DTYPE=float32; fi
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(grep -owE 'avx512f|avx512_bf16|amx_bf16|avx2' /proc/cpuinfo | sort -u | xargs); dtype $DTYPE; aserve $(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --short HEAD 2>/dev/null || echo '?')"
VLLM_VENV=${VLLM_VENV:-${TMPDIR:-/tmp}/aserve-peers/vllm-venv}
[[ -x $VLLM_VENV/bin/vllm ]] || { echo "no vLLM at $VLLM_VENV: run benchmarks/setup_vllm_cpu.sh first (or set VLLM_VENV)" >&2; exit 2; }
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-${TMPDIR:-/tmp}/aserve-peers/vllm-cache}
