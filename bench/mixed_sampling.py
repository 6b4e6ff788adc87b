#!/usr/bin/env python3
"""What one request that needs more than the plain draw (logprobs, penalties, a JSON mask) costs a batch.

Before 2026-12-03 such a row made its step read at once (no overlap), sent the whole batch's logits to
the host, float32, and sampled every row there (engine._sample_on_host). Measured at 63a14e4 (one row in
a greedy batch, ms a token): 1B b32 12.7-17.0 against 1.39 plain, 8B b32 16.3-16.7 against 4.86. Since
63a14e4 a JSON row is masked and sampled on the device (1B b32 1.45, 8B b32 4.86); now every row is
(runtime/step_sampling.py), penalty rows once the step before is read. Prediction
for a logprobs row (sampled at launch, a log_softmax and a top-k of one row, its copy): ~plain + 0.05 ms;
a penalty row (after the read, the whole step's logits copied to float32, index lists uploaded): 1B b32
~1.5 ms, 8B b32 ~4.9.

Here (CPU):    python bench/gpu_bench.py prepare --shapes 1b,8b --cache .kc
On the device: python bench/mixed_sampling_device.py --shapes 1b,8b --cache .kc --out $OUT/mixed

Per shape and batch B (random-weight checkpoint and bundle as bench/gpu_bench.py makes them, 128 prompt
tokens, 128 greedy tokens a row): B plain greedy rows, then B-1 of them plus one greedy row asking for
logprobs, plus one with repetition and frequency penalties, and plus one JSON row (json_schema: an
object of one string), each with the old rule and whole-batch host sampler patched in and with the
engine as it is. The random checkpoints' tokens are
words 't<id>' (no JSON punctuation), so the JSON masks read a vocabulary of as many texts whose first 95
are the printable ASCII characters (the engine's json_vocab replaced; only the masks read it). Prints
tok/s and ms a token after the first, checks old and new give the same tokens; JSON under --out.
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


def timed_run(engine, ids_list, last, out_len: int) -> tuple[list, float, float]:
    """ids_list greedy, the last row with SamplingParams `last` (None: plain too): (tokens, s, ms a token)."""
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
    return [s.output_ids for s in seqs], total, (total - (first - t0)) / (out_len - 1) * 1000


def main():
    import gpu_bench
    import torch
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
        bundle = gpu_bench.plain_bundle(shape, args.work, args.cache)
        vocab = gpu_bench.model_config(shape).vocab_size
        engine = Engine(load(bundle, device="cuda"), EngineConfig(max_num_seqs=256, max_batched_tokens=8192))
        from engc.runtime.json_mode import JsonVocab
        from engc.runtime.sampling import SamplingParams
        engine.__dict__["json_vocab"] = JsonVocab([chr(32 + i) if i < 95 else f"t{i}" for i in range(vocab)])
        new_mixed, new_device_samples = Engine._sample_mixed, Engine._device_samples
        old_device_samples = lambda self, seq: seq.params.device_sampleable and (   # noqa: E731 (the old rule)
            seq.params.greedy or self.model.sampler is not None)
        logprobs = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0, logprobs=1)
        penalty = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0, repetition_penalty=1.1,
                                 frequency_penalty=0.2)
        # an object whose one string value takes every 't<id>' text: the row runs its 128 tokens (under a
        # bare json_object a greedy random model may close the object at its second token)
        json_row = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True, json_schema={
            "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})
        variants = [("plain", None, False)] + [(f"{kind}_{age}", row, age == "old") for kind, row in (
            ("logprobs", logprobs), ("penalty", penalty), ("json", json_row)) for age in ("old", "new")]
        variants.append(("plain_again", None, False))
        for b in batches[shape]:
            ids = gpu_bench.prompts(b, 128, vocab, 7)
            timed_run(engine, ids[:4], json_row, 8)    # warm: graphs, the JSON vocabulary's first masks
            r = {"shape": shape, "batch": b, "commit": args.commit, "gpu": torch.cuda.get_device_name()}
            toks = {}
            for name, last, old in variants:
                Engine._sample_mixed = old_sample_mixed if old else new_mixed
                Engine._device_samples = old_device_samples if old else new_device_samples
                toks[name], total, step_ms = timed_run(engine, ids, last, 128)
                r[f"{name}_tok_s"] = round(b * 128 / total, 1)
                r[f"{name}_ms_per_token"] = round(step_ms, 3)
            Engine._sample_mixed, Engine._device_samples = new_mixed, new_device_samples
            for kind in ("logprobs", "penalty", "json"):
                r[f"{kind}_old_new_tokens_identical"] = toks[f"{kind}_old"] == toks[f"{kind}_new"]
            r["json_row_tokens"] = len(toks["json_new"][-1])
            results.append(r)
            print(json.dumps(r), flush=True)
        del engine
        torch.cuda.empty_cache()
    (out / "mixed_sampling.json").write_text(json.dumps(results, indent=1))
    print("\n== one logprobs / penalty / JSON row in a greedy batch: tok/s (ms a token after the first) ==")
    for r in results:
        cells = [f"{n} {r[n + '_tok_s']:,.0f} ({r[n + '_ms_per_token']})" for n, _, _ in variants]
        print(f"  {r['shape']:4} b{r['batch']:<3} " + "  ".join(cells))
        print(f"            same tokens old/new: logprobs {r['logprobs_old_new_tokens_identical']}, penalty "
              f"{r['penalty_old_new_tokens_identical']}, json {r['json_old_new_tokens_identical']} "
              f"(JSON row: {r['json_row_tokens']} tokens)")


if __name__ == "__main__":
    main()
