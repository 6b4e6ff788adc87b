#!/usr/bin/env bash
# Build a bundle for the GPUs you serve on, on a CPU-only CI runner, and check it before it ships:
#
#   bash examples/ci/build.sh SRC OUT [ARCHS]      # SRC: an HF folder, a .gguf file or `default`
#
# 1. engc build SRC --arch ARCHS with a kernel cache (ENGC_KERNEL_CACHE, default .engc-kernel-cache; the CI
#    restores and saves that folder, keyed by kernel_cache_key below, so unchanged kernels never compile twice)
# 2. engc verify: every file's sha256 against the manifest
# 3. a second build into a scratch folder: the same digest, byte for byte (a build that is not reproducible
#    fails here, before anyone serves it)
# 4. OUT/build.json: `engc build --json`'s summary (digest, archs, kernels per arch, sizes, step timings),
#    for the pipeline's artifact and logs
# Needs engc with its compiler extras (pip install 'engc[compiler]'); nvcc on PATH adds the CUDA C++ kernels.
set -euo pipefail
SRC=${1:?usage: build.sh SRC OUT [ARCHS]}
OUT=${2:?usage: build.sh SRC OUT [ARCHS]}
ARCHS=${3:-sm80,sm90}
export ENGC_KERNEL_CACHE=${ENGC_KERNEL_CACHE:-.engc-kernel-cache}
mkdir -p "$ENGC_KERNEL_CACHE"

echo "kernel cache key: $(python3 -m engc.compiler.kernel_cache)"
engc build "$SRC" -o "$OUT" --arch "$ARCHS" --json > "$OUT.build.json"
mv "$OUT.build.json" "$OUT.json"
engc verify "$OUT"
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
engc build "$SRC" -o "$check/again" --arch "$ARCHS" --json > "$check/again.json"
python3 - "$OUT.json" "$check/again.json" <<'PY'
import json, sys
first, again = (json.load(open(p)) for p in sys.argv[1:])
if first["digest"] != again["digest"]:
    sys.exit(f"the rebuild differs: digest {first['digest']} then {again['digest']}")
print(f"reproducible: digest {first['digest']}, {first['bytes']:,} bytes, kernels {first['kernels_by_arch']}")
PY
diff -r "$OUT" "$check/again" > /dev/null
