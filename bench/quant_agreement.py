"""Greedy agreement of an int4 bundle with the float bundle of the same model (SmolLM2-135M by default).

    python bench/quant_agreement.py [--src default] [--method awq] [--group-size 128] [--work DIR]
                                    [--out bench/results/quant_agreement_smollm2.json]

Two measures, both on the CPU reference path:
- teacher-forced: over held-out real text (the held-out half of the Python language reference,
  calibration.python_reference, which no quantizer calibrates on), windows of --window tokens every
  --window tokens; at each position, does
  the int4 bundle's argmax equal the float bundle's?
- free-running: greedy 64-token continuations of a few chat prompts (EOS ignored); the length of the
  common prefix of the two continuations, and the fraction of positions that agree.
Reuses DIR/b_float and DIR/q_<method>_g<g> / DIR/b_<method>_g<g> if bench/quant_ppl.py made them there
(same names and calibration settings), else quantizes and builds them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from engc.compiler.build import BuildOptions, build
from engc.compiler.quantize import QuantOptions
from engc.compiler.quantize.calibration import python_reference
from engc.compiler.quantize.stream import quantize_checkpoint
from engc.llm import LLM
from engc.runtime.eval import _forward
from engc.runtime.kv_cache import KVCache
from engc.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of France, and what is it famous for?",
           "Write a short Python function that reverses a string.",
           "Explain in two sentences why the sky is blue.",
           "Give three tips for staying focused while studying."]


def argmaxes(model, ids: list[int], window: int) -> torch.Tensor:
    """Greedy next token at every position, over non-overlapping windows of the text."""
    kv = KVCache(model.config, -(-window // model.block_size), model.block_size,
                 getattr(model, "kv_dtype", None) or model.dtype, model.device)
    out = [_forward(model, kv, ids[b:b + window]).argmax(-1) for b in range(0, len(ids) - 1, window)]
    return torch.cat(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="default")
    ap.add_argument("--method", default="awq")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seqlen", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--work", default="/tmp/engc_quant_bench")
    ap.add_argument("--out", default=str(ROOT / "bench/results/quant_agreement_smollm2.json"))
    args = ap.parse_args()
    work = Path(args.work)
    key = f"{args.method}_g{args.group_size}"
    if not (work / "b_float").exists():
        build(args.src, work / "b_float", BuildOptions())
    if not (work / f"b_{key}").exists():
        opts = QuantOptions(method=args.method, group_size=args.group_size, calib_samples=args.calib_samples,
                            calib_seqlen=args.calib_seqlen)
        quantize_checkpoint(args.src, work / f"q_{key}", opts)
        build(str(work / f"q_{key}"), work / f"b_{key}", BuildOptions())
    ref, q = LLM(str(work / "b_float")), LLM(str(work / f"b_{key}"))

    t = time.monotonic()
    ids = ref.tokenizer.encode(python_reference("heldout"), add_special_tokens=False)[:args.eval_tokens]
    a, b = argmaxes(ref.model, ids, args.window), argmaxes(q.model, ids, args.window)
    teacher = {"positions": a.numel(), "agree": round(float((a == b).float().mean()), 4),
               "text": f"first {len(ids)} tokens of the held-out half of the Python language reference, "
                       f"windows of {args.window}, no overlap", "seconds": round(time.monotonic() - t, 1)}
    print("teacher-forced", json.dumps(teacher), flush=True)

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    runs = []
    for prompt, x, y in zip(PROMPTS, ref.generate(PROMPTS, params, chat=True), q.generate(PROMPTS, params, chat=True)):
        prefix = next((i for i, (u, v) in enumerate(zip(x.token_ids, y.token_ids)) if u != v), len(x.token_ids))
        same = sum(u == v for u, v in zip(x.token_ids, y.token_ids)) / len(x.token_ids)
        runs.append({"prompt": prompt, "common_prefix": prefix, "positions_agree": round(same, 4),
                     "float": x.text, "int4": y.text})
        print(f"prefix {prefix:2d}/{len(x.token_ids)}  agree {same:.2f}  {prompt}", flush=True)
    result = {"command": "python bench/quant_agreement.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "model": args.src, "quantized": key,
              "calibration": f"{args.calib_samples} x {args.calib_seqlen} tokens of the calibration half",
              "teacher_forced": teacher,
              "free_running": {"new_tokens": args.new_tokens, "chat_template": True, "runs": runs,
                               "mean_common_prefix": sum(r["common_prefix"] for r in runs) / len(runs)}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{key} vs float: teacher-forced greedy agreement {teacher['agree']:.1%} over "
          f"{teacher['positions']} positions; free-running {args.new_tokens}-token continuations share "
          f"{result['free_running']['mean_common_prefix']:.1f} tokens on average before diverging")


if __name__ == "__main__":
    main()
