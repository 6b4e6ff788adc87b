"""Held-out perplexity of RTN, AWQ and GPTQ int4 vs the float model (SmolLM2-135M-Instruct by default).

    python bench/quant_ppl.py [--src default] [--groups 128,32] [--methods rtn,awq,gptq] [--work DIR]
                              [--calib FILE|reference]
        (a method gptq+act: GPTQ with act-order, its static groups; gptq+act+dynamic: groups in act order)

Calibrates on the default corpus (engc.compiler.quantize.calibration: its Python-reference part is the
calibration half), or with --calib reference on that half alone, and scores the held-out half of the Python language reference, so no evaluated token
was seen by a quantizer. Every bundle is scored with the same windows and stride. Writes
DIR/results.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engc.compiler.build import BuildOptions, build
from engc.compiler.quantize import QuantOptions
from engc.compiler.quantize.calibration import python_reference
from engc.compiler.quantize.stream import quantize_checkpoint
from engc.runtime.eval import EvalOptions, perplexity
from engc.runtime.loader import load


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="default")
    ap.add_argument("--groups", default="128,32")
    ap.add_argument("--methods", default="rtn,awq,gptq")
    ap.add_argument("--work", default="/tmp/engc_quant_bench")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seqlen", type=int, default=256)
    ap.add_argument("--calib", default=None,
                    help="calibration file; 'reference': the Python reference's calibration half alone")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    text = python_reference("heldout")
    calib = args.calib
    if calib == "reference":  # the calibration domain of the scored text, and nothing else
        calib = str(work / "calib_reference.txt")
        Path(calib).write_text(python_reference("calibration"))
    ev = EvalOptions(window=args.window, stride=args.stride, max_tokens=args.eval_tokens)

    def score(key: str, bundle: Path, extra: dict):
        t = time.monotonic()
        r = perplexity(load(bundle), text, ev)
        results[key] = dict(extra, ppl=r["ppl"], scored=r["scored"], eval_seconds=round(time.monotonic() - t, 1))
        results_path.write_text(json.dumps(results, indent=1, sort_keys=True))
        print(key, json.dumps(results[key]), flush=True)

    if "float" not in results:
        build(args.src, work / "b_float", BuildOptions())
        score("float", work / "b_float", {})
    for g in map(int, args.groups.split(",")):
        for m in args.methods.split(","):
            key = f"{m}_g{g}"
            if key in results:
                continue
            method, *flags = m.split("+")
            opts = QuantOptions(method=method, group_size=g, calib=calib, calib_samples=args.calib_samples,
                                calib_seqlen=args.calib_seqlen, act_order="act" in flags,
                                static_groups="dynamic" not in flags)
            summary = quantize_checkpoint(args.src, work / f"q_{key}", opts)
            build(str(work / f"q_{key}"), work / f"b_{key}", BuildOptions())
            score(key, work / f"b_{key}", {"quantize_seconds": summary["seconds"],
                                            "peak_rss_mb": summary["peak_rss_mb"]})
    print_table(results)


def print_table(results: dict):
    print("| group size | float | RTN | AWQ | GPTQ |\n|---|---|---|---|---|")
    for g in (128, 64, 32):
        row = [results.get(f"{m}_g{g}", {}).get("ppl") for m in ("rtn", "awq", "gptq")]
        if any(row):
            cells = " | ".join(f"{p:.3f}" if p else "-" for p in row)
            print(f"| {g} | {results['float']['ppl']:.3f} | {cells} |")


if __name__ == "__main__":
    main()
