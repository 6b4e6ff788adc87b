#!/bin/bash
# HTTP serving benchmark on one H200: bench/serve_bench.py (streaming sampled chat, workload "mix": temperature
# 0.8, top-p 0.95, top-k 50, ignore_eos) against `engc run` and then LMDeploy 0.18's PyTorch-engine api_server,
# one after the other, on the same random-weight Llama-3-8B-shaped HF folder (bench/shapes.py; engc's bundle is
# built from it here with .kc as kernel cache).
#
#   here:   python bench/gpu_bench.py prepare --shapes 8b --cache .kc; bash ../shared/peer/prepare.sh (fills .peer);
#           then the api_server's and serve_bench's own wheels, which prepare.sh leaves out:
#           pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#             --platform manylinux2014_x86_64 -d .peer/wheels "openai<3" jiter distro sniffio httpx httpcore h11 anyio
#           (openai 3 imports httpx2, which LMDeploy's api_server does not get)
#   device: bash bench/serve_h200.sh    carry [".kc", ".whl", ".peer"]; about 8 minutes, finish by BUDGET (545 s)
#   here:   SERVE_LOCAL=1 bash bench/serve_h200.sh
#           a CPU rehearsal: the "tiny" shape, engc on the CPU, a few requests; LMDeploy only with LMD_LAUNCH and
#           PEER_PP set (a launcher that fakes its engine: its CLI flags, template, tokenizer and HTTP path)
#
# Steps: setup (bench/device_env.sh; .peer/wheels into /tmp/site as .peer/run.sh does) ~30 s; checkpoint + serving
# tokenizer/template + bundle ~60 s; engc: start ~10 s, warm-up ~10 s, levels c=1,16,64,256 ~70 s, rates 8,32/s
# ~35 s (when the rest still fits); LMDeploy: start ~50 s, warm-up, levels ~80 s, rates; table, plot, finish.
# Both servers: max batch 256, KV cache 0.5 of the free memory (bench_lmdeploy.py's cache_max_entry_count), their
# own defaults otherwise (engc: prefix cache on, 2048-token prefill chunks; LMDeploy: session 4096, prefill 8192).
#
# Everything lands in /tmp/gb (back as $OUT/gb.tgz): serve_engc.json, serve_lmdeploy.json (levels, ready_s,
# warm_s, bench_s), serve.png, serve_summary.json, the parts (serve_LABEL_PART.json, bench_*.log, cpu_*.txt),
# prep.log, engc_server.log, lmdeploy_server.log.
# Settings (environment): SHAPE, CONC, REQS, RATES (empty: none), RATE_REQS, BUDGET, LMD=0 (engc only), ENGC=0
# (LMDeploy only).
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD

if [ "${SERVE_LOCAL:-0}" = 1 ]; then
  # the helpers of bench/device_env.sh without its installs (this machine has engc and its deps)
  set -u
  export PYTHONUNBUFFERED=1
  T0=$(date +%s)
  OUT=${OUT:-/tmp/serve_local_out}
  rm -rf /tmp/gb
  mkdir -p "$OUT" /tmp/gb
  el() { echo $(( $(date +%s) - T0 ))s; }
  clean() { rm -rf "$WORK"; }
  finish() { (cd /tmp && tar czf "$OUT/gb.tgz" gb); echo "done $(el)"; }
  WORK=${WORK:-/tmp/serve_local_work}
  DEVICE=cpu
  SHAPE=${SHAPE:-tiny}
  CONC=${CONC:-1,2}
  REQS=${REQS:-3}
  RATES=${RATES-}
  RATE_REQS=${RATE_REQS:-4}
  BUDGET=${BUDGET:-900}
  LMD=${LMD:-$([ -n "${LMD_LAUNCH:-}" ] && echo 1 || echo 0)}
  PEER_PP=${PEER_PP:-}       # the LMDeploy deps' site folder(s) (the device installs .peer/wheels into /tmp/site)
  BENCH_PP=${BENCH_PP:-}     # serve_bench's httpx (here: this machine's)
else
  source bench/device_env.sh   # installs .whl and engc (editable); T0, el, clean, finish; /tmp/gb
  WORK=/tmp/engc_work
  DEVICE=cuda
  SHAPE=${SHAPE:-8b}
  CONC=${CONC:-1,16,64,256}
  REQS=${REQS:-20}             # c=1: 20 requests; c=16/64/256: serve_bench sends 4x the concurrency
  RATES=${RATES-8,32}          # the short rate sweep (Poisson arrivals), each server's only when time allows
  RATE_REQS=${RATE_REQS:-128}
  BUDGET=${BUDGET:-545}        # the device command's limit is 560 s
  LMD=${LMD:-1}
  # LMDeploy's deps: .peer/wheels into /tmp/site as .peer/run.sh does (PYTHONPATH=/tmp/site:.peer);
  # serve_bench's httpx and httpcore into a site of their own (their deps anyio/h11/certifi/idna come from .whl)
  rm -rf /tmp/site /tmp/bsite
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .peer/wheels/*.whl \
    > /tmp/gb/pip_peer.log 2>&1 || tail -3 /tmp/gb/pip_peer.log
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/bsite \
    .peer/wheels/httpx-*.whl .peer/wheels/httpcore-*.whl .peer/wheels/sniffio-*.whl > /tmp/gb/pip_bench.log 2>&1 || tail -3 /tmp/gb/pip_bench.log
  PEER_PP=/tmp/site
  BENCH_PP=/tmp/bsite
  echo "peer site installed $(el)"
fi
LMD_LAUNCH=${LMD_LAUNCH:-python3 -m lmdeploy}
ENGC=${ENGC:-1}
MODEL=m                        # the name both servers answer to
PORT_E=23391
PORT_L=23392
KV_FRACTION=0.5                # bench_lmdeploy.py's cache_max_entry_count; engc's --cache-max-entry-count alike
SAMPLING="--temperature 0.8 --top-p 0.95 --top-k 50"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
gpu_mem() { [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1 || echo 0; }

# ----------------------------------------------------------------------------------------------------------------
# the checkpoint (random bf16, seed 0: bench/shapes.py), a serving tokenizer and chat template in it, the bundle
cat > /tmp/gb/serve_prep.py <<'PY'
"""Makes WORK/ckpt-SHAPE (bench/shapes.py's random checkpoint) where missing, gives it a tokenizer that knows
serve_bench's words (else every prompt word is the unknown token t0, every prompt the same ids, and engc's
prefix cache would skip nearly all prefill) and a Llama-3-like chat template (both servers read the same
folder; LMDeploy takes the template from tokenizer_config.json as its "hf" template), and builds the bundle."""
import ast
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, "bench")
import torch  # noqa: E402

import shapes  # noqa: E402

shape, work, cache, device = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
res = {"shape": shape}
if device == "cpu":   # the CPU rehearsal: shapes.py draws its weights on the GPU
    class CPUWeights(shapes._RandomWeights):
        def __init__(self, dtype, int4):
            self.torch, self.dtype, self.int4 = torch, dtype, int4
            self.g = torch.Generator().manual_seed(0)

        def rand(self, *shape, std=0.02):
            return (torch.randn(*shape, generator=self.g, dtype=torch.float32) * std).to(self.dtype)
    shapes._RandomWeights = CPUWeights

ckpt = shapes.checkpoint_dir(work, shape)
t = time.perf_counter()
if not (ckpt / "config.json").exists():
    shapes.make_checkpoint(shape, ckpt)
    res["make_checkpoint_s"] = round(time.perf_counter() - t, 1)

# ---- the serving tokenizer: serve_bench's words, Llama 3's specials, one token a whitespace-split word
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from tokenizers import AddedToken  # noqa: E402

src = Path("bench/serve_bench.py").read_text()
words = next(eval(compile(ast.Expression(n.value), "serve_bench", "eval")) for n in ast.parse(src).body
             if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "WORDS")
vocab_size = json.loads((ckpt / "config.json").read_text())["vocab_size"]
names = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
special_ids = [128000, 128001, 128006, 128007, 128009] if vocab_size > 128009 else \
    list(range(vocab_size - 5, vocab_size))
specials = dict(zip(names, special_ids))
first_word = 1000 if vocab_size > 5000 else 100
vocab = {f"t{i}": i for i in range(vocab_size)}
for k, w in enumerate(list(words) + ["user", "assistant", "system"]):
    del vocab[f"t{first_word + k}"]
    vocab[w] = first_word + k
for name, i in specials.items():
    del vocab[f"t{i}"]
    vocab[name] = i
tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
tok.save(str(ckpt / "tokenizer.json"))
template = ("{{ bos_token }}{% for m in messages %}<|start_header_id|> {{ m['role'] }} <|end_header_id|> "
            "{{ m['content'] }} <|eot_id|> {% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|> {% endif %}")
(ckpt / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
    "unk_token": "t0", "model_max_length": 8192, "chat_template": template}, indent=1))
(ckpt / "chat_template.jinja").write_text(template)
res["tokenizer_probe"] = tok.encode("<|begin_of_text|><|start_header_id|> user <|end_header_id|> time person zzz "
                                    "<|eot_id|>").ids
res["words_known"] = len(words)

# ---- the bundle (as shapes.plain_bundle and gpu_bench build it)
from engc.compiler.build import BuildOptions, build  # noqa: E402

bundle = work / f"bundle-{shape}-serve"
t = time.perf_counter()
if sys.argv[5] == "0":   # ENGC=0: LMDeploy alone needs the folder only
    print("PREP " + json.dumps({**res, "ckpt": str(ckpt), "bundle": ""}), flush=True)
    sys.exit(0)
if not (bundle / "manifest.json").exists():
    build(str(ckpt), bundle, BuildOptions(archs=("sm90",) if device == "cuda" else ("cpu",),
                                          dtype="float32" if shape == "tiny" else "bfloat16", kernel_cache=cache,
                                          kv_cache=shapes.kv_cache_of(shape), quant=shapes.quant_of(shape),
                                          tp=shapes.tp_of(shape)))
    res["build_s"] = round(time.perf_counter() - t, 1)
manifest = json.loads((bundle / "manifest.json").read_text())
res["kernels_compiled_by_triton"] = sorted({k["triton_version"] for k in manifest.get("kernels", [])
                                            if "triton_version" in k})
if device == "cuda":
    import triton
    res["cache_miss"] = triton.__version__ in res["kernels_compiled_by_triton"]
res["ckpt"], res["bundle"] = str(ckpt), str(bundle)
res["ckpt_files"] = sorted(p.name for p in ckpt.iterdir() if not p.name.endswith(".safetensors"))
print("PREP " + json.dumps(res), flush=True)
PY

echo "== checkpoint and bundle: $SHAPE $(el)"
timeout $(( $(left) < 240 ? $(left) : 240 )) python3 /tmp/gb/serve_prep.py "$SHAPE" "$WORK" "$ROOT/.kc" "$DEVICE" \
  "$ENGC" > /tmp/gb/prep.log 2>&1
rc=$?
PREP=$(grep '^PREP ' /tmp/gb/prep.log | tail -1 | cut -c6-)
echo "[prep rc=$rc $(el)] $PREP"
if [ $rc != 0 ] || [ -z "$PREP" ]; then
  tail -30 /tmp/gb/prep.log
  finish
  exit 1
fi
CKPT=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["ckpt"])' "$PREP")
BUNDLE=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["bundle"])' "$PREP")
echo "$PREP" | grep -q '"cache_miss": true' && echo "   CACHE MISS: the device's Triton compiled the kernels (prepare .kc at this commit)"

# ----------------------------------------------------------------------------------------------------------------
# servers: started in a session of their own (the group is stopped), ready when GET /v1/models answers 200
SRV_PID=
SETSID=$(command -v setsid || true)
start_server() {   # LOG CMD...
  local log=$1
  shift
  LAUNCHED=$(date +%s.%N)
  $SETSID "$@" > "$log" 2>&1 &
  SRV_PID=$!
}

wait_ready() {     # URL TIMEOUT -> prints the seconds from launch to the first 200, or DIED/TIMEOUT
  python3 - "$1" "$SRV_PID" "$LAUNCHED" "$2" <<'PY'
import sys, time, urllib.request
url, pid, launched, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
def alive():
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
while time.time() - launched < timeout:
    if not alive():
        print("DIED")
        sys.exit(2)
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
            if r.status == 200:
                print(round(time.time() - launched, 2))
                sys.exit(0)
    except Exception:
        pass
    time.sleep(0.2)
print("TIMEOUT")
sys.exit(1)
PY
}

stop_server() {    # [quick]: stops SRV_PID's process group; on the GPU (not quick) waits until its memory is free
  [ -n "$SRV_PID" ] || return 0
  local i n=100
  [ "${1:-}" = quick ] && n=25
  kill -TERM -- -"$SRV_PID" 2>/dev/null || kill -TERM "$SRV_PID" 2>/dev/null
  for i in $(seq $n); do kill -0 "$SRV_PID" 2>/dev/null || break; sleep 0.2; done
  kill -KILL -- -"$SRV_PID" 2>/dev/null || kill -KILL "$SRV_PID" 2>/dev/null
  wait "$SRV_PID" 2>/dev/null
  SRV_PID=
  if [ "$DEVICE" = cuda ] && [ "${1:-}" != quick ]; then
    for i in $(seq 40); do [ "$(gpu_mem)" -lt 2000 ] && break; sleep 0.5; done
    if [ "$(gpu_mem)" -ge 2000 ]; then   # a process of the server outside its group: this machine's GPU is ours
      nvidia-smi --query-compute-apps=pid --format=csv,noheader | while read -r p; do kill -KILL "$p" 2>/dev/null; done
      sleep 3
    fi
    echo "   stopped; GPU memory used $(gpu_mem) MiB $(el)"
  fi
}
trap 'stop_server quick' EXIT

# ----------------------------------------------------------------------------------------------------------------
# serve_bench. Each level is a run of its own with its own seed: serve_bench draws a level's requests from its
# seed, so one run's levels would begin with the same prompts, which a server with a prefix cache (engc's is on
# by default, LMDeploy's off) would find cached from the level before. A warm-up run first (mix, seed 999, c=32:
# prefill shapes compiled on first use, e.g. LMDeploy's Triton kernels, stay out of the figures).
# While a run goes, the CPU time of the client (serve_bench: one Python process parsing every streamed chunk)
# and of the server's main process is sampled twice a second: client_cpu / server_cpu of a level are the cores
# they kept busy; a client near 1.0 is the limit of that level, not the server. A run cut short keeps the
# levels it printed.
TCK=$(getconf CLK_TCK 2>/dev/null || echo 100)
cpu_s() { awk -v tck="$TCK" '{ sub(/^.*\) /, ""); print ($12 + $13) / tck }' /proc/"$1"/stat 2>/dev/null || echo nan; }

serve_bench() {    # LABEL PART URL TIMEOUT ARGS...: one serve_bench run into /tmp/gb/serve_LABEL_PART.json
  local label=$1 part=$2 url=$3 to=$4
  shift 4
  local log=/tmp/gb/bench_${label}_$part.log out=/tmp/gb/serve_${label}_$part.json cpu=/tmp/gb/cpu_${label}_$part.txt
  timeout "$to" env PYTHONPATH="$BENCH_PP" python3 bench/serve_bench.py run --url "$url" --model "$MODEL" \
    --label "$label" --workload mix $SAMPLING --out "$out" "$@" > "$log" 2>&1 &
  local tpid=$! cpid=
  : > "$cpu"
  while kill -0 $tpid 2>/dev/null; do
    [ -n "$cpid" ] || cpid=$(awk '{print $1}' /proc/$tpid/task/$tpid/children 2>/dev/null)
    [ -n "$cpid" ] && echo "$(date +%s.%N) $(cpu_s "$cpid") $(cpu_s "$SRV_PID") $(grep -c '"output_tok_s"' "$log")" >> "$cpu"
    sleep 0.5
  done
  wait $tpid
  local rc=$?
  [ $rc = 0 ] || { echo "   serve_bench $label $part rc=$rc"; tail -3 "$log"; }
  python3 - "$label" "$log" "$out" "$url" "$cpu" <<'PY'
import json, sys
from pathlib import Path
label, log, out, url, cpu = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
if not out.exists():   # cut short: the levels it printed
    levels = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and ("concurrency" in d or "rate" in d):
            levels.append(d)
    if not levels:
        sys.exit(0)
    out.write_text(json.dumps({"label": label, "url": url, "model": "m", "workload": "mix", "partial": True,
                               "levels": levels}))
rows = []
for line in cpu.read_text().splitlines():
    try:
        t, c, s, n = line.split()
        rows.append((float(t), float(c), float(s), int(n)))
    except ValueError:
        continue
def at(t, col):   # CPU seconds at time t, interpolated between samples
    pts = [(r[0], r[col]) for r in rows if r[col] == r[col]]
    if not pts or t < pts[0][0] or t > pts[-1][0]:
        return None
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v0
    return pts[-1][1]
d = json.loads(out.read_text())
for k, lv in enumerate(d["levels"]):
    # the level ended at the first sample that saw it printed (the last level: else the last sample)
    end = next((r[0] for r in rows if r[3] >= k + 1), rows[-1][0] if rows and k == len(d["levels"]) - 1 else None)
    if end is None or not lv.get("seconds"):
        continue
    start = max(end - lv["seconds"], rows[0][0])
    for col, name in ((1, "client_cpu"), (2, "server_cpu")):
        a, b = at(start, col), at(end, col)
        if a is not None and b is not None and end - start >= 0.5:
            lv[name] = round((b - a) / (end - start), 2)
out.write_text(json.dumps(d, indent=1))
PY
}

merge() {          # LABEL PART...: the parts' levels, in order, into /tmp/gb/serve_LABEL.json (appended if it exists)
  python3 - "$@" <<'PY'
import json, sys
from pathlib import Path
label, parts = sys.argv[1], sys.argv[2:]
out = Path(f"/tmp/gb/serve_{label}.json")
report = json.loads(out.read_text()) if out.exists() else None
for p in parts:
    f = Path(f"/tmp/gb/serve_{label}_{p}.json")
    if not f.exists():
        continue
    d = json.loads(f.read_text())
    for lv in d["levels"]:
        lv["run"] = p
    if report is None:
        report = dict(d, levels=[])
        report.pop("partial", None)
        report["note"] = "each level a serve_bench run of its own, seed = the level's concurrency (rates: 500 + i)"
    report["levels"] += d["levels"]
    report["partial"] = report.get("partial", False) or d.get("partial", False)
if report is not None:
    out.write_text(json.dumps(report, indent=1))
PY
}

bench_server() {   # LABEL URL DEADLINE (epoch seconds): warm-up, then the concurrency levels
  local label=$1 url=$2 deadline=$3 parts=() c to t
  t=$(date +%s)
  to=$(( deadline - t ))
  serve_bench "$label" warm "$url" $(( to < 60 ? to : 60 )) --seed 999 --concurrency 32 --requests 32
  note "$label" warm_s $(( $(date +%s) - t ))
  for c in ${CONC//,/ }; do
    to=$(( deadline - $(date +%s) ))
    [ $to -ge 10 ] || { echo "   $label: no time left for c=$c"; break; }
    serve_bench "$label" "c$c" "$url" $to --seed "$c" --concurrency "$c" --requests "$REQS"
    parts+=("c$c")
  done
  merge "$label" "${parts[@]}"
}

bench_rates() {    # LABEL URL DEADLINE: the rate levels, appended to serve_LABEL.json
  local label=$1 url=$2 deadline=$3 parts=() r i=0 to
  for r in ${RATES//,/ }; do
    to=$(( deadline - $(date +%s) ))
    [ $to -ge 8 ] || { echo "   $label: no time left for rate $r"; break; }
    serve_bench "$label" "r$r" "$url" $to --seed $(( 500 + i )) --concurrency "" --rates "$r" --requests "$RATE_REQS"
    parts+=("r$r")
    i=$(( i + 1 ))
  done
  merge "$label" "${parts[@]}"
}

note() {           # LABEL KEY VALUE: a figure of the run, in serve_summary.json and serve_LABEL.json
  python3 - "$@" <<'PY'
import json, sys
from pathlib import Path
label, key, value = sys.argv[1:4]
try:
    value = json.loads(value)
except ValueError:
    pass
summary = Path("/tmp/gb/serve_summary.json")
d = json.loads(summary.read_text()) if summary.exists() else {}
d.setdefault(label, {})[key] = value
summary.write_text(json.dumps(d, indent=1))
PY
}

now() { date +%s; }
min() { echo $(( $1 < $2 ? $1 : $2 )); }

# ----------------------------------------------------------------------------------------------------------------
# engc
if [ "$ENGC" = 1 ]; then
note engc prep "$PREP"
echo "== engc run $(el)  (GPU memory used $(gpu_mem) MiB)"
start_server /tmp/gb/engc_server.log python3 -m engc.cli run "$BUNDLE" --device "$DEVICE" --host 127.0.0.1 \
  --port $PORT_E --served-model-name $MODEL --max-batch-size 256 \
  $([ "$DEVICE" = cuda ] && echo --cache-max-entry-count $KV_FRACTION)
READY_E=$(wait_ready http://127.0.0.1:$PORT_E "$(min 150 $(( $(left) - 100 )))")
echo "[engc ready: $READY_E s $(el)]"
note engc ready_s "$READY_E"
BENCH_E_S=0
if [[ "$READY_E" =~ ^[0-9.]+$ ]]; then
  t=$(now)
  KEEP=$([ "$LMD" = 1 ] && echo 150 || echo 20)   # what LMDeploy's run needs after engc's levels
  bench_server engc http://127.0.0.1:$PORT_E $(( t + $(min 220 $(( $(left) - KEEP > 40 ? $(left) - KEEP : 40 ))) ))
  BENCH_E_S=$(( $(now) - t ))
  note engc bench_s $BENCH_E_S
  echo "[engc bench ${BENCH_E_S}s $(el)]"
  # the rate sweep only where LMDeploy's start, its levels (~1.25x engc's) and its own sweep still fit after it
  if [ -n "$RATES" ] && [ $(( $(left) - 45 - 90 - BENCH_E_S * 5 / 4 - 45 - 15 )) -gt 0 ]; then
    t=$(now)
    bench_rates engc http://127.0.0.1:$PORT_E $(( t + 45 ))
    echo "[engc rates $(( $(now) - t ))s $(el)]"
  elif [ -n "$RATES" ]; then
    echo "   engc: no time for the rate sweep"
  fi
else
  grep -E "Error|error|Traceback" /tmp/gb/engc_server.log | tail -5
  tail -25 /tmp/gb/engc_server.log
fi
stop_server
fi

# ----------------------------------------------------------------------------------------------------------------
# LMDeploy's api_server (PyTorch engine) on the same HF folder
if [ "$LMD" = 1 ] && [ "$(left)" -gt 80 ]; then
  echo "== LMDeploy api_server $(el)"
  start_server /tmp/gb/lmdeploy_server.log env PYTHONPATH="${PEER_PP:+$PEER_PP:}$ROOT/.peer" HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false $LMD_LAUNCH serve api_server "$CKPT" --backend pytorch \
    --server-name 127.0.0.1 --server-port $PORT_L --model-name $MODEL --max-batch-size 256 --session-len 4096 \
    --cache-max-entry-count $KV_FRACTION
  READY_L=$(wait_ready http://127.0.0.1:$PORT_L "$(min 180 $(( $(left) - 60 )))")
  echo "[lmdeploy ready: $READY_L s $(el)]"
  note lmdeploy ready_s "$READY_L"
  if [[ "$READY_L" =~ ^[0-9.]+$ ]]; then
    t=$(now)
    bench_server lmdeploy http://127.0.0.1:$PORT_L $(( t + $(min 260 $(( $(left) - 15 ))) ))
    BENCH_L_S=$(( $(now) - t ))
    note lmdeploy bench_s $BENCH_L_S
    echo "[lmdeploy bench ${BENCH_L_S}s $(el)]"
    if [ -n "$RATES" ] && [ -f /tmp/gb/serve_engc_r${RATES%%,*}.json ] && [ "$(left)" -gt 60 ]; then
      t=$(now)
      bench_rates lmdeploy http://127.0.0.1:$PORT_L $(( t + $(min 45 $(( $(left) - 15 ))) ))
      echo "[lmdeploy rates $(( $(now) - t ))s $(el)]"
    fi
  else
    grep -E "Error|error|Traceback|No module" /tmp/gb/lmdeploy_server.log | tail -8
    tail -25 /tmp/gb/lmdeploy_server.log
  fi
  stop_server quick
elif [ "$LMD" = 1 ]; then
  echo "== LMDeploy skipped: $(left)s left"
fi

# ----------------------------------------------------------------------------------------------------------------
# the table, the plot
python3 - <<'PY'
import json
from pathlib import Path
rep = {k: json.loads(p.read_text()) for k in ("engc", "lmdeploy") if (p := Path(f"/tmp/gb/serve_{k}.json")).exists()}
summary = json.loads(Path("/tmp/gb/serve_summary.json").read_text()) if Path("/tmp/gb/serve_summary.json").exists() else {}
for k in ("engc", "lmdeploy"):
    s = summary.get(k, {})
    if k in rep:   # the run's figures beside its levels
        rep[k].update({x: s[x] for x in ("ready_s", "warm_s", "bench_s", "prep") if x in s})
        Path(f"/tmp/gb/serve_{k}.json").write_text(json.dumps(rep[k], indent=1))
    print(f"{k:9} ready {s.get('ready_s', '-')} s, warm-up {s.get('warm_s', '-')} s, levels {s.get('bench_s', '-')} s"
          + (" (partial)" if rep.get(k, {}).get("partial") else ""))
Path("/tmp/gb/serve_summary.json").write_text(json.dumps(summary, indent=1))
def key(lv):
    return ("c", lv["concurrency"]) if lv.get("concurrency") else ("r", lv.get("rate"))
levels = {}
for k, r in rep.items():
    for lv in r["levels"]:
        levels.setdefault(key(lv), {})[k] = lv
f = lambda v, w=7: f"{v:>{w}}" if v is not None else " " * (w - 1) + "-"
W = {"tok/s": 9, "cpu c/s": 9}
cols = ("tok/s", "TTFTp50", "p99", "ITLp50", "p99", "err", "cpu c/s")
head = " ".join(f"{c:>{W.get(c, 7)}}" for c in cols)
blank = " ".join(f"{'-':>{W.get(c, 7)}}" for c in cols)
print(f"{'':>6} | {'engc':<{len(head)}} | {'LMDeploy':<{len(head)}} |")
print(f"{'level':>6} | {head} | {head} | engc/LMD")
for (kind, v), by in sorted(levels.items()):
    row = f"{kind + str(v):>6} |"
    for k in ("engc", "lmdeploy"):
        lv = by.get(k)
        if lv is None:
            row += f" {blank} |"
        else:
            cpu = f"{lv.get('client_cpu', '-')}/{lv.get('server_cpu', '-')}"
            row += (f" {f(lv['output_tok_s'], 9)} {f(lv['ttft_ms_p50'])} {f(lv['ttft_ms_p99'])} {f(lv['itl_ms_p50'])}"
                    f" {f(lv['itl_ms_p99'])} {lv['errors']:>7} {cpu:>9} |")
    e, l = by.get("engc"), by.get("lmdeploy")
    row += f" {e['output_tok_s'] / l['output_tok_s']:8.2f}" if e and l and l["output_tok_s"] else "        -"
    print(row)
print("(output tok/s; TTFT and ITL in ms; cpu c/s: cores busy in the client (serve_bench) / the server's main process)")
for k, r in rep.items():
    errs = sorted({x for lv in r["levels"] for x in lv.get("first_errors", [])})
    if errs:
        print(f"{k} errors: {errs[:3]}")
    print(f"{k} prompt tokens mean per level: {[lv.get('prompt_tokens_mean') for lv in r['levels']]}")
PY
PLOTS=$(ls /tmp/gb/serve_engc.json /tmp/gb/serve_lmdeploy.json 2>/dev/null)
if [ -n "$PLOTS" ]; then
  env PYTHONPATH="$BENCH_PP" timeout $(( $(left) > 35 ? 30 : 5 )) python3 bench/serve_bench.py plot $PLOTS -o /tmp/gb/serve.png \
    > /tmp/gb/plot.log 2>&1 && echo "plot: /tmp/gb/serve.png" \
    || { tail -1 /tmp/gb/plot.log; echo "no plot here: python3 bench/serve_bench.py plot serve_engc.json serve_lmdeploy.json -o serve.png"; }
fi
trap - EXIT
finish
