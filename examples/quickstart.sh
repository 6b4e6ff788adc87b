#!/usr/bin/env bash
# The README's quick start: set up, build the embedded default model, answer a question, serve it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
engc build default -o bundles/smollm2
engc generate bundles/smollm2 --prompt "What is the capital of France?" --max-tokens 32
