"""Held-out perplexity with the KV cache in the model dtype, int8 and fp8 (SmolLM2-135M-Instruct by default).

    python bench/kv_quant_ppl.py [--src default] [--work DIR]

Builds one CPU bundle per --kv-cache setting from the same source and scores each on the same windows
of the held-out half of the Python language reference as bench/quant_ppl.py (so "auto" is that
table's float figure). Every window is one prefill whose queries attend over the quantized cache, so
the figure includes the quantization of K and V at every position. Also reports how often each quantized
bundle's greedy next token equals the unquantized one's over those positions. Writes DIR/results.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engc.compiler.build import BuildOptions, build
from engc.compiler.quantize.calibration import python_reference
from engc.runtime.eval import EvalOptions, perplexity
from engc.runtime.loader import load


def greedy_tokens(model, ids: list[int], window: int) -> torch.Tensor:
    """argmax of the logits at every position of consecutive windows (one prefill each)."""
    from engc.runtime.kv_cache import KVCache
    out, bs = [], model.block_size
    for start in range(0, len(ids) - window + 1, window):
        chunk = ids[start:start + window]
        n = len(chunk)
        inputs = {"input_ids": torch.tensor(chunk), "positions": torch.arange(n), "slot_mapping": torch.arange(n),
                  "block_tables": torch.arange(-(-n // bs), dtype=torch.int32)[None],
                  "context_lens": torch.tensor([n], dtype=torch.int32),
                  "query_start_loc": torch.tensor([0, n], dtype=torch.int32), "logits_indices": torch.arange(n)}
        kv = KVCache(model.config, -(-n // bs), bs, model.kv_dtype, "cpu")
        with torch.inference_mode():
            out.append(model.executor.forward(inputs, kv.layers).argmax(-1))
    return torch.cat(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="default")
    ap.add_argument("--work", default="/tmp/engc_kv_quant_ppl")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(2)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    text = python_reference("heldout")
    ev = EvalOptions(window=args.window, stride=args.window, max_tokens=args.eval_tokens)
    results, tokens = {}, {}
    for kv in ("auto", "int8", "fp8"):
        bundle = work / f"bundle-{kv}"
        if not (bundle / "manifest.json").exists():
            build(args.src, bundle, BuildOptions(kv_cache=kv))
        t = time.monotonic()
        model = load(bundle)
        r = perplexity(model, text, ev)
        ids = model.tokenizer.encode(text, add_special_tokens=False)[:args.eval_tokens]
        tokens[kv] = greedy_tokens(model, ids, args.window)
        results[kv] = {"ppl": r["ppl"], "scored": r["scored"], "seconds": round(time.monotonic() - t, 1)}
        if kv != "auto":
            results[kv]["greedy_agreement_vs_auto"] = float((tokens[kv] == tokens["auto"]).float().mean())
        print(kv, json.dumps(results[kv]), flush=True)
    results["settings"] = {"src": args.src, "window": args.window, "stride": args.window,
                           "eval_tokens": args.eval_tokens, "text": "python_reference('heldout')"}
    (work / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    print("| kv cache | perplexity | greedy next token = auto |\n|---|---|---|")
    for kv in ("auto", "int8", "fp8"):
        print(f"| {kv} | {results[kv]['ppl']:.3f} | {results[kv].get('greedy_agreement_vs_auto', 1.0):.4f} |")


if __name__ == "__main__":
    main()
