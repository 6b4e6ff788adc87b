"""The large FP8 GEMMs of an fp8 bundle (prefill, batches past the fp8_linear M classes): torch._scaled_mm with
row-wise scales, fast accumulation (the tensor cores' accumulator over the whole K) against promotion to float32
every 128 products, at a model's projection shapes. Each: TFLOP/s, and the error against float32 of the same
float8 codes (max |y - ref| / max |ref|), beside the error the bfloat16 output's own rounding gives.

    python bench/fp8_gemm_bench.py [--shape 8b] [--rows 1024,2048,8192] [--out results.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from engc.kernels.fp8_quant import quantize_rows
from shapes import model_config


def quantized(rows: int, cols: int, std: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 codes, float32 scale a row) of a random [rows, cols] matrix, quantized as engc's build and kernels
    quantize weights and activations."""
    return quantize_rows(torch.randn(rows, cols, generator=gen, device="cuda") * std)


def timed_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def projections(cfg) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of a decoder layer's projections (gate and up as one)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (cfg.hidden_size, q + 2 * kv), "o": (q, cfg.hidden_size),
            "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size), "down": (cfg.intermediate_size, cfg.hidden_size)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--rows", default="1024,2048,8192")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape, "rows": {}}
    print(f"{'proj':8} {'M':>5} {'fast TF/s':>10} {'slow TF/s':>10} {'fast err':>9} {'slow err':>9} {'bf16 err':>9}")
    for m in (int(r) for r in args.rows.split(",")):
        for name, (k, n) in projections(model_config(args.shape)).items():
            xq, xs = quantized(m, k, 1.0, gen)
            wq, ws = quantized(n, k, 0.02, gen)
            ref = (xq.float() * xs[:, None]) @ (wq.float() * ws[:, None]).t()
            row = {}
            for mode, fast in (("fast", True), ("slow", False)):
                def run():
                    return torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :],
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)
                ms = timed_ms(run)
                row[f"{mode}_tflops"] = round(2 * m * n * k / ms / 1e9, 1)
                row[f"{mode}_rel_err"] = float((run().float() - ref).abs().max() / ref.abs().max())
            row["bf16_rounding_rel_err"] = float((ref.bfloat16().float() - ref).abs().max() / ref.abs().max())
            res["rows"][f"{name}_m{m}"] = row
            print(f"{name:8} {m:5} {row['fast_tflops']:10} {row['slow_tflops']:10} {row['fast_rel_err']:9.2e} "
                  f"{row['slow_rel_err']:9.2e} {row['bf16_rounding_rel_err']:9.2e}", flush=True)
            del xq, wq, ref
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
