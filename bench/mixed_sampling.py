#!/usr/bin/env python3
"""What one request that needs more than the plain draw (logprobs, penalties, a JSON mask) costs a greedy batch.

Here (CPU):    python bench/gpu_bench.py prepare --shapes 1b,8b --cache .kc
On the device: python bench/mixed_sampling.py --shapes 1b,8b --cache .kc --out $OUT/mixed

Per shape and batch B (random-weight checkpoint and bundle as bench/gpu_bench.py makes them, reused from its
--work folder; 128 prompt tokens, 128 greedy tokens a row): B plain greedy rows, then B-1 of them plus one
row asking for logprobs, one with repetition and frequency penalties, and one JSON row (json_schema: an
object of one string), then plain again. The random checkpoints' tokens are words 't<id>' (no JSON
punctuation), so the JSON masks read a vocabulary of as many texts whose first 95 are the printable ASCII
characters (only the masks read it; its last id stands for the end of a sequence). Prints tok/s and ms a token after the first (the comparable figure:
later runs reuse the same prompts, so their tok/s gain prefix-cache hits); JSON under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import shapes  # noqa: E402


def timed_run(engine, ids_list, last, out_len: int) -> tuple[float, float]:
    """ids_list greedy, the last row with SamplingParams `last` (None: plain too): (s, ms a token after the first)."""
    import torch
    from engc.runtime.sampling import SamplingParams
    plain = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0)
    seqs = [engine.add_request(ids, last if last is not None and i == len(ids_list) - 1 else plain)
            for i, ids in enumerate(ids_list)]
    torch.cuda.synchronize()
    t0, first = time.perf_counter(), None
    while engine.has_work:
        engine.step()
        if first is None and all(s.output_ids for s in seqs):
            first = time.perf_counter()
    total = time.perf_counter() - t0
    return total, (total - (first - t0)) / (out_len - 1) * 1000


def special_rows() -> list[tuple[str, object]]:
    from engc.runtime import constrained
    from engc.runtime.sampling import SamplingParams
    base = dict(max_tokens=128, ignore_eos=True, temperature=0)
    # an object whose one string value takes every 't<id>' text: the row runs its 128 tokens (under a bare
    # json_object a greedy random model may close the object at its second token)
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    return [("plain", None), ("logprobs", SamplingParams(**base, logprobs=1)),
            ("penalty", SamplingParams(**base, repetition_penalty=1.1, frequency_penalty=0.2)),
            ("json", SamplingParams(**base, grammar=constrained.json_schema(schema))), ("plain_again", None)]


def bench_shape(shape: str, batches: list[int], args) -> list[dict]:
    import torch
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime import constrained
    from engc.runtime.loader import load
    bundle = shapes.plain_bundle(shape, args.work, args.cache)
    vocab = shapes.model_config(shape).vocab_size
    engine = Engine(load(bundle, device="cuda"), EngineConfig(max_num_seqs=256, max_batched_tokens=8192))
    texts = [chr(32 + i) if i < 95 else f"t{i}" for i in range(vocab)]
    engine.__dict__["grammar_vocab"] = constrained.vocab_of_tokens([t.encode() for t in texts], eos=vocab - 1)
    rows, results = special_rows(), []
    for b in batches:
        ids = shapes.prompts(b, 128, vocab, 7)
        timed_run(engine, ids[:4], dict(rows)["json"], 8)    # warm: graphs, the JSON vocabulary's first masks
        r = {"shape": shape, "batch": b, "commit": args.commit, "gpu": torch.cuda.get_device_name(),
             "date": time.strftime("%Y-%m-%d")}
        for name, last in rows:
            total, step_ms = timed_run(engine, ids, last, 128)
            r[f"{name}_tok_s"] = round(b * 128 / total, 1)
            r[f"{name}_ms_per_token"] = round(step_ms, 3)
        results.append(r)
        print(json.dumps(r), flush=True)
    del engine
    torch.cuda.empty_cache()
    return results


def main():
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
    results = [r for shape in args.shapes.split(",") for r in bench_shape(shape, batches[shape], args)]
    (out / "mixed_sampling.json").write_text(json.dumps(results, indent=1))
    print("\n== one logprobs / penalty / JSON row in a greedy batch: tok/s (ms a token after the first) ==")
    for r in results:
        cells = [f"{n} {r[n + '_tok_s']:,.0f} ({r[n + '_ms_per_token']})" for n, _ in special_rows()]
        print(f"  {r['shape']:4} b{r['batch']:<3} " + "  ".join(cells))


if __name__ == "__main__":
    main()
