#!/usr/bin/env bash
# The README's quick start: set up, build the embedded default model, answer a question, serve it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
engc() { python3 -m engc.cli "$@"; }   # the same as the installed `engc` command, without a PATH lookup
engc build default -o bundles/smollm2
engc generate bundles/smollm2 --prompt "What is the capital of France?" --max-tokens 32
# ENGC_PORT picks the port; without it 23333, or a free port when 23333 is taken (engc prints which)
port=${ENGC_PORT:-23333}
if [ -z "${ENGC_PORT:-}" ] && ! python3 -c "import socket; socket.create_server(('127.0.0.1', $port)).close()" 2>/dev/null; then
  echo "port $port is in use: serving on a free port instead"
  port=0
fi
echo "OpenAI + Anthropic APIs; Ctrl-C to stop"
exec python3 -m engc.cli run bundles/smollm2 --port "$port"
