#!/usr/bin/env python3
"""The sampling kernels alone on the GPU: microseconds a draw (the op's four launches) at several batch sizes
and tile configs, torch.argmax beside it, for a Llama-3 vocabulary (128,256) of bf16 logits.

    python bench/sampling_kernel_bench.py [--rows 1,32,64,256] [--out FILE.json]
    python bench/sampling_kernel_bench.py --configs 0,8 --modes sampled,top_k,top_p,min_p   # ranks vs selects

Each config is the tune table's entry with overrides, built by the op's own spec builder and launch rule,
compiled here by Triton (JIT, not the bundle's AOT cubins) and timed from a CUDA graph of 20 draws; its tokens
must equal the table's config's on the same inputs (same uniforms), or the row says so.
Rows are sampled as the serving benchmarks sample (temperature 0.8, top-k 50, top-p 0.95) over logits shaped
like a model's (a few dozen plausible tokens above a normal floor); "greedy" rows have temperature 0, and
--modes times each filter alone (which of the kernel's phases a row pays for).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engc.bundle.model_config import ModelConfig   # noqa: E402
from engc.compiler.codegen.kernel_spec import Build   # noqa: E402
from engc.kernels import sampling   # noqa: E402
from engc.kernels.sampling.specs import specs as sampling_specs   # noqa: E402
from timing import graph_replay_ms   # noqa: E402

VOCAB = 128256
# a row's (temperature, top_k, top_p, min_p) in each mode: which of the kernel's paths it takes
MODES = {"sampled": (0.8, 50, 0.95, 0.0), "greedy": (0.0, 50, 0.95, 0.0), "temperature": (0.8, 0, 1.0, 0.0),
         "top_k": (0.8, 50, 1.0, 0.0), "top_p": (0.8, 0, 0.95, 0.0), "min_p": (0.8, 0, 1.0, 0.05)}
# overrides of the tune table's sampling/*/any entry; the first ({}) is the table's own. pairwise: the small
# gather's thresholds from ranks, its candidates streamed that many a step (0: from radix selects, as the full
# gather's): --configs 0,8 times the table against selects alone, 0,9,10 the ranks' step
CONFIGS = [{}, {"radix": 4}, {"radix": 1}, {"num_warps": 8}, {"radix": 4, "num_warps": 8}, {"max_splits": 16},
           {"radix": 4, "max_splits": 16}, {"groups": 32, "radix": 4}, {"pairwise": 0}, {"pairwise": 4},
           {"pairwise": 16}]


def logits_like_a_model(rows: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, VOCAB, device="cuda", generator=gen) * 2.0
    top = torch.randint(0, VOCAB, (rows, 40), device="cuda", generator=gen)
    x.scatter_(1, top, 12.0 + 3.0 * torch.rand(rows, 40, device="cuda", generator=gen))
    return x.to(torch.bfloat16).contiguous()


def graph_us(fn, launches: int = 20) -> float:
    """Microseconds a launch of fn, from replays of a graph of `launches` of them back to back."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    return graph_replay_ms(g) * 1000 / launches


def label(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items()) or "table"


def sampler(logits, params, cfg):
    """A draw's launches over logits with the table's entry overridden by cfg, as a function to time."""
    cfg_ = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=1,
                       num_heads=4, num_kv_heads=4, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                       max_position_embeddings=256, tie_word_embeddings=False)
    arch = "sm%d%d" % torch.cuda.get_device_capability()
    specs = {s.variant: s for s in sampling_specs(Build(cfg=cfg_, t="bf16", arch=arch, block_size=16,
                                                        overrides={"sampling": cfg}))}
    consts = {v: s.launch for v, s in specs.items()}
    out = torch.empty(logits.shape[0], dtype=torch.int64, device="cuda")
    temperature, top_k, top_p, uniform, min_p = params
    launches = sampling.launch(logits, temperature, top_k, top_p, uniform, min_p, out, consts)

    def fn():
        for variant, grid, args in launches:
            s = specs[variant]
            s.fn()[grid](*args[:-2], **s.constexprs, num_warps=s.num_warps, num_stages=s.num_stages)
    return fn, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,32,64,256")
    ap.add_argument("--out", default=None)
    ap.add_argument("--modes", default="sampled,greedy",
                    help="comma-separated filters a row uses, each timed alone: " + ", ".join(MODES))
    ap.add_argument("--table-only", action="store_true", help="only the tune table's config (the first)")
    ap.add_argument("--configs", default=None, help="comma-separated indices into CONFIGS (default: all)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "vocab": VOCAB, "rows": {}}
    configs = CONFIGS[:1] if args.table_only else CONFIGS
    if args.configs:
        configs = [CONFIGS[int(i)] for i in args.configs.split(",")]
    for i, cfg in enumerate(configs):
        print(f"config {i}: {label(cfg)}")
    print(f"{'rows':>5} {'mode':>11} " + " ".join(f"{'config %d' % i:>13}" for i in range(len(configs)))
          + "   torch.argmax")
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = logits_like_a_model(rows, gen)
        for mode in args.modes.split(","):
            temp, top_k, top_p, min_p = MODES[mode]
            params = (torch.full((rows,), temp, device="cuda"), torch.full((rows,), top_k, dtype=torch.int32,
                      device="cuda"), torch.full((rows,), top_p, device="cuda"),
                      torch.rand(rows, device="cuda", generator=gen), torch.full((rows,), min_p, device="cuda"))
            line, ref = [], None
            figures = res["rows"].setdefault(str(rows), {}).setdefault(mode, {})
            for cfg in configs:
                try:
                    fn, out = sampler(logits, params, cfg)
                    us = graph_us(fn)
                    same = ref is None or torch.equal(out, ref)
                    ref = out.clone() if ref is None else ref
                    line.append(f"{us:10.1f}{'' if same else ' !='}")
                    figures[label(cfg)] = {"us": round(us, 2), "same_tokens": same}
                except Exception as e:   # a config that does not compile or fit: say so, go on
                    line.append(f"{'fail':>10}")
                    figures[label(cfg)] = {"error": repr(e)[:200]}
            am = graph_us(lambda: torch.argmax(logits, -1))
            figures["torch_argmax_us"] = round(am, 2)
            print(f"{rows:>5} {mode:>11} " + " ".join(f"{s:>13}" for s in line) + f"   {am:10.1f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
