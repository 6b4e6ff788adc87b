#!/usr/bin/env python3
"""Programmatic dependent launch changes timing, never results: greedy tokens with PDL on and off.

A PDL kernel may start while the kernel before it still runs and must wait (griddepcontrol.wait) before
it touches that kernel's data; a missing or misplaced wait is a race that shows as different tokens.
The kernels' split reductions sum in a fixed order, so with and without PDL the tokens must be identical.

Here (CPU):    python bench/gpu_bench.py prepare --shapes 1b,1b-int4 --cache .kcache
On the device: python bench/pdl_device.py --shapes 1b,1b-int4 --cache .kcache --out $OUT/pdl

Per shape: random-weight checkpoint and bundle as bench/gpu_bench.py makes them; 8 prompts x 64 greedy
tokens through the engine (CUDA graphs, batches of 8 then 1) with ENGC_PDL=1 and ENGC_PDL=0, each in a
fresh load; prints whether the tokens match and the batch-1 step time of each. JSON under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def tokens(bundle: Path, pdl: bool, vocab: int) -> tuple[list, float]:
    import torch
    import gpu_bench
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime.loader import load
    os.environ["ENGC_PDL"] = "1" if pdl else "0"        # read when the bundle's kernels are loaded
    model = load(bundle, device="cuda")
    engine = Engine(model, EngineConfig(max_num_seqs=8, num_blocks=512))
    seqs, _, _ = gpu_bench.run_batch(engine, gpu_bench.prompts(8, 100, vocab, 5), 64)
    out = [s.output_ids for s in seqs]
    seqs, total, first = gpu_bench.run_batch(engine, gpu_bench.prompts(1, 100, vocab, 6), 64)
    out.append(seqs[0].output_ids)
    step_ms = (total - first) / 63 * 1000
    del engine, model
    torch.cuda.empty_cache()
    return out, step_ms


def main():
    import gpu_bench
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1b,1b-int4")
    ap.add_argument("--cache", default=str(ROOT / ".kcache"))
    ap.add_argument("--work", default="/tmp/engc_work")
    ap.add_argument("--out", default="/tmp/engc_pdl")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for shape in args.shapes.split(","):
        t = time.perf_counter()
        bundle = gpu_bench.plain_bundle(shape, args.work, args.cache)
        vocab = gpu_bench.model_config(gpu_bench.base_shape(shape)).vocab_size
        on, on_ms = tokens(bundle, True, vocab)
        off, off_ms = tokens(bundle, False, vocab)
        same = [a == b for a, b in zip(on, off)]
        first_diff = next(([i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)]
                           for i, (a, b) in enumerate(zip(on, off)) if a != b), None)
        r = {"shape": shape, "commit": args.commit, "identical": all(same), "rows_identical": same,
             "first_difference (row, token)": first_diff, "b1_step_ms_pdl": round(on_ms, 3),
             "b1_step_ms_no_pdl": round(off_ms, 3), "seconds": round(time.perf_counter() - t, 1)}
        results.append(r)
        print(json.dumps(r), flush=True)
    (out / "pdl_check.json").write_text(json.dumps(results, indent=1))
    print("\n== PDL on vs off: greedy tokens (9 sequences x 64) ==")
    for r in results:
        print(f"  {r['shape']:10} identical={r['identical']}  b1 step {r['b1_step_ms_pdl']} ms with PDL, "
              f"{r['b1_step_ms_no_pdl']} ms without")


if __name__ == "__main__":
    main()
