#!/usr/bin/env bash
# The README's quick start: set up, build the embedded default model, answer a question, serve it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
engc() { python3 -m engc.cli "$@"; }   # the same as the installed `engc` command, without a PATH lookup
engc build default -o bundles/smollm2
engc generate bundles/smollm2 --prompt "What is the capital of France?" --max-tokens 32
echo "serving on http://127.0.0.1:23333 (OpenAI + Anthropic APIs; Ctrl-C to stop)"
exec python3 -m engc.cli run bundles/smollm2 --port 23333
