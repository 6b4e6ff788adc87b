#!/usr/bin/env bash
# engc on Ray Serve (engc/runtime/server/ray_serve.py): replicas of one bundle, one per GPU across the
# Ray cluster, autoscaled on the requests each holds, behind Ray's HTTP proxy on every node.
#
#   one host:    bash examples/ray_serve.sh BUNDLE [key=value ...]
#   many hosts:  on the head node the same command; on each other node, before or after it:
#                  ray start --address HEAD_IP:6379
#
# key=value: name=MODEL, min_replicas=1, max_replicas=N, target_ongoing_requests=32,
# max_ongoing_requests=256, cpus_per_replica=1, api_key=KEY, and EngineConfig fields (max_num_seqs=256,
# num_blocks=..., max_waiting=...). Without a GPU the replicas run on the CPU (device=cpu).
# The OpenAI and Anthropic APIs are on port SERVE_PORT (8000) of every node; BUNDLE must be at the same
# path on each (a shared file system, or a copy). `ray stop` on each node ends it.
set -euo pipefail
bundle=$(realpath "${1:?usage: ray_serve.sh BUNDLE [key=value ...]}")
shift
device=cpu
(nvidia-smi -L 2>/dev/null | grep -q '^GPU') && device=cuda
ray status >/dev/null 2>&1 || ray start --head --port 6379 --include-dashboard false
serve start --http-host "${SERVE_HOST:-0.0.0.0}" --http-port "${SERVE_PORT:-8000}" --proxy-location EveryNode
exec serve run --route-prefix / engc.runtime.server.ray_serve:app bundle="$bundle" device="$device" "$@"
