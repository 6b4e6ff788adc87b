# Sourced at the start of a command on the GPU machine (the `device` tool), from the checkout's root:
#
#   here:  python3 -m pip download --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
#              --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
#              -d .whl fastapi uvicorn pydantic gguf llguidance jsonschema
#          rm .whl/numpy-*    # the image has numpy, onnx, click, jinja2, prometheus-client, scikit-build-core
#          python3 bench/gpu_bench.py prepare --shapes 8b,1b --cache .kc       # kernels compiled here
#          git rev-parse --short HEAD > .kc/commit
#   there: source bench/device_env.sh; gb s8b 240 --shapes 8b; clean; gb s1b 150 --shapes 1b; finish
#          (KC=DIR before sourcing: a kernel cache other than .kc, its commit file in it)
#          (carry [".kc", ".whl"]; everything comes back as $OUT/gb.tgz)
#
# The image's `pip` is not its python3's (python3 is /opt/torch/.venv): always `python3 -m pip`, or the
# editable install fails and every GPU test skips. A warm machine keeps the last command's /tmp: an 8B bundle
# is 16 GB of a 64 GB disk, so /tmp/engc_work goes first.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
# KEEP_WORK=1: keep the last command's checkpoints and bundles (a warm machine; --quick reuses a bundle by name)
[ "${KEEP_WORK:-0}" = 1 ] || rm -rf /tmp/engc_work
rm -rf /tmp/gb
mkdir -p "$OUT" /tmp/gb
el() { echo $(( $(date +%s) - T0 ))s; }
python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn uvloop httptools pydantic gguf llguidance jsonschema \
  > /tmp/gb/pip.log 2>&1 \
  || tail -5 /tmp/gb/pip.log
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/gb/pip2.log 2>&1 || tail -20 /tmp/gb/pip2.log
COMMIT=$(cat ${KC:-.kc}/commit 2>/dev/null || echo unknown)
echo "setup done $(el) commit $COMMIT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader

# gb NAME TIMEOUT ARGS...: one `gpu_bench.py run --quick --no-hf` (a fresh process per shape), its log and JSON
# under /tmp/gb/NAME, the headline figures printed
gb() {
  local name=$1 to=$2
  shift 2
  timeout "$to" python3 bench/gpu_bench.py run --cache "${KC:-.kc}" --no-hf --quick --out /tmp/gb/$name \
    --commit "$COMMIT" "$@" > /tmp/gb/$name.log 2>&1
  echo "[$name rc=$? $(el)]"
  python3 - /tmp/gb/$name <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    d = json.load(open(f))
    if isinstance(d, dict) and "shape" in d:
        keep = [k for k in d if (k[:1] == "b" and k[1:2].isdigit()) or k == "kernels_compiled_by_triton"]
        print("  ", d["shape"], {k: d[k] for k in keep})
        import triton
        if triton.__version__ in d.get("kernels_compiled_by_triton", []):   # the device's Triton built them
            print("   CACHE MISS: these kernels were compiled on this machine by its Triton, not taken from .kc "
                  "(not comparable with runs that hit it); prepare .kc at this commit")
PY
}

# clean: the checkpoints and bundles of earlier gb runs off the 64 GB disk. 8b-int4 and 8b-int4-qhead, then 8b,
# in one command filled it (16 GB a bf16 8B checkpoint and as much a bundle): clean before a shape that
# shares nothing with the last
clean() { rm -rf /tmp/engc_work /dev/shm/engc_work; }

# finish: everything under /tmp/gb back as one file ($OUT returns at most 8)
finish() { (cd /tmp && tar czf "$OUT/gb.tgz" gb); echo "done $(el)"; }
