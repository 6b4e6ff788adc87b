#!/usr/bin/env bash
# N `engc run` replicas of one bundle on this host, one per GPU (or N on the CPU), behind sglang-router
# with cache-aware routing: requests that share a prompt prefix go to the replica that holds its KV.
#
#   bash examples/replicas.sh BUNDLE [N] [ROUTER_PORT] [-- engc run flags...]
#
# N defaults to the number of GPUs (1 without any); ROUTER_PORT to 30000. Each replica listens on a free
# loopback port; the router on 127.0.0.1:ROUTER_PORT (ROUTER_HOST=0.0.0.0 to expose it). Flags after --
# go to every `engc run` (e.g. --served-model-name NAME --max-batch-size 64). Ctrl-C stops them all.
# A line "replica I pid PID url URL" is printed for each replica, then "router url URL" when it serves.
set -euo pipefail
bundle=${1:?usage: replicas.sh BUNDLE [N] [ROUTER_PORT] [-- engc run flags...]}
shift
gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
n=${gpus:-0}; [ "$n" -gt 0 ] || n=1
port=30000
[ $# -gt 0 ] && [ "$1" != "--" ] && { n=$1; shift; }
[ $# -gt 0 ] && [ "$1" != "--" ] && { port=$1; shift; }
[ $# -gt 0 ] && [ "$1" = "--" ] && shift
logs=$(mktemp -d)
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$logs"; }
trap stop EXIT
trap 'exit 130' INT TERM

cores=$(nproc)
urls=()
for ((i = 0; i < n; i++)); do
  if [ "$gpus" -gt 0 ]; then   # one GPU each
    CUDA_VISIBLE_DEVICES=$((i % gpus)) python3 -m engc.cli run "$bundle" --port 0 "$@" >"$logs/$i.log" 2>&1 &
  else                          # the CPU's cores shared out, so replicas do not fight over threads
    OMP_NUM_THREADS=$(( cores / n > 0 ? cores / n : 1 )) \
      python3 -m engc.cli run "$bundle" --port 0 --device cpu "$@" >"$logs/$i.log" 2>&1 &
  fi
  pids+=($!)
done
for ((i = 0; i < n; i++)); do   # engc run's first line names its address
  until url=$(grep -oE 'http://[^ ]+' "$logs/$i.log" 2>/dev/null | head -1) && [ -n "$url" ]; do
    kill -0 "${pids[$i]}" 2>/dev/null || { echo "replica $i failed:" >&2; cat "$logs/$i.log" >&2; exit 1; }
    sleep 0.5
  done
  until curl -sf "$url/health" >/dev/null; do sleep 0.5; done
  urls+=("$url")
  echo "replica $i pid ${pids[$i]} url $url"
done

# cache_aware: the prefix tree per replica, shortest queue when the load is uneven. A replica that fails
# once is taken out at once (circuit breaker) and the request retried on another; the breaker tries it
# again after its timeout.
python3 -m sglang_router.launch_router --host "${ROUTER_HOST:-127.0.0.1}" --port "$port" \
  --worker-urls "${urls[@]}" --policy cache_aware --cb-failure-threshold 1 --health-check-interval-secs 5 \
  --log-level warn &
pids+=($!)
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
  kill -0 "${pids[-1]}" 2>/dev/null || { echo "the router failed to start" >&2; exit 1; }
  sleep 0.5
done
echo "router url http://127.0.0.1:$port"
wait "${pids[-1]}"   # a replica that dies is the router's to route around; the router ending ends all
