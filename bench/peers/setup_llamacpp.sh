#!/bin/sh
# Create bench/peers/.venv-llamacpp with llama-cpp-python built from source for this CPU.
# The build compiles llama.cpp (about 8 minutes on 2 cores); it runs at low priority.
# Usage: sh bench/peers/setup_llamacpp.sh [python3]
set -eu
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="$HERE/.venv-llamacpp"
PYTHON="${1:-python3}"
LLAMA_CPP_PYTHON_VERSION="0.3.36"
NUMPY_VERSION="2.4.6"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "numpy==$NUMPY_VERSION"
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    nice -n 19 "$VENV/bin/python" -m pip install --no-cache-dir \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready in $VENV')"
