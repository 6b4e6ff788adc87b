#!/usr/bin/env python3
"""What one request that needs the host sampler (logprobs, penalties, JSON masks) costs a batch.

Such a row makes its step read at once (no overlap). Before 2026-12-03 it also sent the whole batch's
logits to the host, float32, and sampled every row there (engine._sample_on_host); now only its own row
goes (engine._sample_mixed) and the other rows are sampled where the logits are. Prediction, 1B at b32:
plain ~1.2 ms a token, the old mixed step ~5-7 ms (16 MB of logits copied, 32 host samples of a 128k row),
the new ~2-2.5 ms (the lost overlap and one row); 8B b32: 4.85 -> ~9 (old) / ~6 (new).

Here (CPU):    python bench/gpu_bench.py prepare --shapes 1b,8b --cache .kc
On the device: python bench/mixed_sampling_device.py --shapes 1b,8b --cache .kc --out $OUT/mixed

Per shape and batch B (random-weight checkpoint and bundle as bench/gpu_bench.py makes them, 128 prompt
tokens, 128 greedy tokens a row): B plain greedy rows; B-1 of them plus one greedy row asking for
logprobs, with the old whole-batch host sampler patched in; the same with the engine as it is. Prints
tok/s and ms a token after the first, checks the two mixed runs give the same tokens; JSON under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def old_sample_mixed(self, logits, sampled):
    """engine._sample_on_host as it was: every row's logits to the host, every row sampled there."""
    from engc.runtime.sampling import sample_row
    rows = logits.float().cpu()
    return [None if s.finished else sample_row(rows[i], s.params, s.prompt_ids, s.output_ids, s.generator,
                                               s.constraint.allowed() if s.constraint else None)
            for i, s in enumerate(sampled)]


def timed_run(engine, ids_list, host_row: bool, out_len: int) -> tuple[list, float, float]:
    import torch
    from engc.runtime.sampling import SamplingParams
    plain = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0)
    asks = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0, logprobs=1)
    seqs = [engine.add_request(ids, asks if host_row and i == len(ids_list) - 1 else plain)
            for i, ids in enumerate(ids_list)]
    torch.cuda.synchronize()
    t0, first = time.perf_counter(), None
    while engine.has_work:
        engine.step()
        if first is None and all(s.output_ids for s in seqs):
            first = time.perf_counter()
    total = time.perf_counter() - t0
    return [s.output_ids for s in seqs], total, (total - (first - t0)) / (out_len - 1) * 1000


def main():
    import gpu_bench
    import torch
    from engc.compiler.build import BuildOptions, build
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime.loader import load
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--batches", default="1b:32,64;8b:32")
    ap.add_argument("--cache", default=str(ROOT / ".kc"))
    ap.add_argument("--work", default="/tmp/engc_work")
    ap.add_argument("--out", default="/tmp/engc_mixed")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = {k: [int(b) for b in v.split(",")] for k, v in (x.split(":") for x in args.batches.split(";"))}
    results = []
    for shape in args.shapes.split(","):
        ckpt, bundle = Path(args.work) / f"ckpt-{shape}", Path(args.work) / f"bundle-{shape}"
        if not (ckpt / "config.json").exists():
            gpu_bench.make_checkpoint(shape, ckpt)
        if not (bundle / "manifest.json").exists():
            build(str(ckpt), bundle, BuildOptions(archs=("sm90",), dtype="bfloat16", kernel_cache=args.cache))
        vocab = gpu_bench.model_config(shape).vocab_size
        engine = Engine(load(bundle, device="cuda"), EngineConfig(max_num_seqs=256, max_batched_tokens=8192))
        new_sampler = Engine._sample_mixed
        for b in batches[shape]:
            ids = gpu_bench.prompts(b, 128, vocab, 7)
            timed_run(engine, ids[:4], True, 8)    # warm: graphs, the host path's first copies
            r = {"shape": shape, "batch": b, "commit": args.commit, "gpu": torch.cuda.get_device_name()}
            toks = {}
            for name, host_row, sampler in (("plain", False, new_sampler), ("mixed_old", True, old_sample_mixed),
                                            ("mixed_new", True, new_sampler), ("plain_again", False, new_sampler)):
                Engine._sample_mixed = sampler
                toks[name], total, step_ms = timed_run(engine, ids, host_row, 128)
                r[f"{name}_tok_s"] = round(b * 128 / total, 1)
                r[f"{name}_ms_per_token"] = round(step_ms, 3)
            Engine._sample_mixed = new_sampler
            r["mixed_old_vs_new_tokens_identical"] = toks["mixed_old"] == toks["mixed_new"]
            r["plain_rows_as_in_plain_batch"] = sum(a == c for a, c in zip(toks["mixed_new"][:-1], toks["plain"][:-1]))
            results.append(r)
            print(json.dumps(r), flush=True)
        del engine
        torch.cuda.empty_cache()
    (out / "mixed_sampling.json").write_text(json.dumps(results, indent=1))
    print("\n== one host-sampled row (logprobs) in a greedy batch: tok/s (ms a token after the first) ==")
    for r in results:
        cells = [f"{n} {r[n + '_tok_s']:,.0f} ({r[n + '_ms_per_token']})" for n in
                 ("plain", "mixed_old", "mixed_new", "plain_again")]
        print(f"  {r['shape']:4} b{r['batch']:<3} " + "  ".join(cells)
              + f"  same tokens old/new: {r['mixed_old_vs_new_tokens_identical']}")


if __name__ == "__main__":
    main()
