#!/usr/bin/env python3
"""FP8 W8A8 projections on the H200: the bundle's per-token quant kernel + torch._scaled_mm vs bf16 F.linear.

Two steps, two machines:
  python bench/fp8_device.py prepare .kcache/fp8_kernels    # here, CPU only: AOT-compile fp8_quant for sm90
  python bench/fp8_device.py run .kcache/fp8_kernels        # on the GPU (no Triton): check, then time

The quant kernel is loaded from its cubin through engc._native, as the runtime does (runtime/gpu_ops.py).
Shapes: the Llama-3-8B decoder projections (qkv, o, gate_up, down) at M in {1, 32, 64, 256, 4096} tokens.
Each timing is a CUDA graph of 20 calls cycling over enough weight copies that no call finds its weight
in L2 (as in a decode step, where each layer's weights are read once), median of 5 replays.
Writes fp8_kernels.json under --out ($OUT); prints a short table last.
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

# Llama-3-8B: hidden 4096, inter 14336, 32 heads x 128, 8 KV heads
PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 32, 64, 256, 4096)
CALLS = 20


def prepare(out: Path):
    import torch
    from engc.bundle.model_config import ModelConfig
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import fp8_quant_specs
    cfg = ModelConfig(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
                      max_position_embeddings=8192, tie_word_embeddings=False)
    t = time.time()
    result = compile_specs(fp8_quant_specs(cfg, "bf16", "sm90"), jobs=1)
    for rel, data in result.files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    (out / "records.json").write_text(json.dumps(result.records, indent=1, sort_keys=True))
    print(f"{len(result.records)} fp8_quant kernels for sm90 in {time.time() - t:.1f}s -> {out}")
    del torch


class Kernels:
    """The fp8_quant cubins, loaded and launched the way runtime/gpu_ops.py's BundleKernels does."""

    def __init__(self, folder: Path):
        from engc.runtime.cubin import load_kernel, signature_from_triton
        self.kernels = {}
        for r in json.loads((folder / "records.json").read_text()):
            sig = signature_from_triton([a["type"] for a in r["args"][:-2]])
            self.kernels[r["variant"]] = load_kernel((folder / r["cubin"]).read_bytes(), r["entry"], sig,
                                                     block_x=32 * r["num_warps"], shared_mem=r["shared_mem"],
                                                     scratch_params=2)

    def run(self, op, launches):
        from engc.runtime.cubin import current_stream
        for variant, grid, args in launches:
            self.kernels[variant].launch(grid, [a.data_ptr() if hasattr(a, "data_ptr") else a for a in args[:-2]],
                                         current_stream())


def fp8_linear(k: Kernels, x, w, w_scale, fast_accum=False):
    import torch
    from engc.kernels import fp8_quant
    xq = torch.empty(x.shape, dtype=fp8_quant.FP8, device=x.device)
    xs = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    k.run("fp8_quant", fp8_quant.launch(x, xq, xs))
    return torch._scaled_mm(xq, w.t(), scale_a=xs[:, None], scale_b=w_scale[None, :], out_dtype=x.dtype,
                            use_fast_accum=fast_accum)


def graph_time(fn, calls=CALLS, replays=5) -> float:
    """Median seconds per call of fn(i) over a CUDA graph of `calls` calls."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1000 / calls)
    return sorted(times)[len(times) // 2]


def check(k: Kernels) -> dict:
    """The kernel bit for bit against quantize_rows; the fp8 GEMM against the op's fp32 reference."""
    import torch
    from engc.kernels.fp8_quant import fp8_linear as reference, quantize_rows
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, (n, kdim) in PROJECTIONS.items():
        x = torch.randn(67, kdim, device="cuda", generator=g).to(torch.bfloat16)
        x[3] = 0
        x[5] *= 1e3
        w = (torch.randn(n, kdim, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        wq, ws = quantize_rows(w)
        xq = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
        xs = torch.empty(x.shape[0], device="cuda")
        from engc.kernels.fp8_quant import launch
        k.run("fp8_quant", launch(x, xq, xs))
        rq, rs = quantize_rows(x)
        y = fp8_linear(k, x, wq, ws).float()
        ref = reference(x.float(), wq, ws)
        bf16 = torch.nn.functional.linear(x, w).float()
        out[name] = {"quant_codes_differing": int((xq.view(torch.uint8) != rq.view(torch.uint8)).sum()),
                     "quant_scale_max_rel_diff": float(((xs - rs).abs() / rs).max()),
                     "gemm_rel_err_vs_fp8_reference": float((y - ref).norm() / ref.norm()),
                     "fp8_rel_err_vs_bf16_linear": float((y - bf16).norm() / bf16.norm())}
        # output is bf16 (2^-9 relative rounding) and accumulation order differs: 1e-2 is generous
        out[name]["ok"] = (out[name]["quant_codes_differing"] == 0 and out[name]["quant_scale_max_rel_diff"] < 1e-6
                           and out[name]["gemm_rel_err_vs_fp8_reference"] < 1e-2)
    return out


def run(folder: Path, out_dir: Path):
    import torch
    import torch.nn.functional as F
    from engc.kernels import fp8_quant
    from engc.kernels.fp8_quant import quantize_rows
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    k = Kernels(folder)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "check": check(k), "timings": {}}
    print(json.dumps(res["check"]), flush=True)
    rows = []
    for name, (n, kdim) in PROJECTIONS.items():
        copies = max(2, -(-400_000_000 // (n * kdim * 2)))  # > 400 MB of bf16 weights cycle: none stays in L2
        w16 = [(torch.randn(n, kdim, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
        w8 = [quantize_rows(w) for w in w16]
        for m in ROWS:
            x = torch.randn(m, kdim, device="cuda").to(torch.bfloat16)
            xq = torch.empty(m, kdim, dtype=fp8_quant.FP8, device="cuda")
            xs = torch.empty(m, device="cuda")
            r = {}
            try:
                r["bf16_us"] = graph_time(lambda i: F.linear(x, w16[i % copies])) * 1e6
                r["fp8_us"] = graph_time(lambda i: fp8_linear(k, x, *w8[i % copies])) * 1e6
                r["fp8_fast_accum_us"] = graph_time(lambda i: fp8_linear(k, x, *w8[i % copies], True)) * 1e6
                r["quant_only_us"] = graph_time(lambda i: k.run("fp8_quant", fp8_quant.launch(x, xq, xs))) * 1e6
                r["speedup"] = r["bf16_us"] / r["fp8_us"]
                r["fp8_weight_TBps"] = n * kdim / (r["fp8_us"] * 1e-6) / 1e12
                r["fp8_TFLOPs"] = 2 * m * n * kdim / (r["fp8_us"] * 1e-6) / 1e12
                r["bf16_TFLOPs"] = 2 * m * n * kdim / (r["bf16_us"] * 1e-6) / 1e12
            except Exception as e:  # report and go on
                r["error"] = repr(e)[:300]
            res["timings"][f"{name}_m{m}"] = r
            rows.append((name, m, r))
        del w16, w8
        torch.cuda.empty_cache()
    res["seconds"] = round(time.time() - t0, 1)
    (out_dir / "fp8_kernels.json").write_text(json.dumps(res, indent=1))
    print(f"\n===== fp8 projections on {res['gpu']} (torch {res['torch']}), {res['seconds']} s =====")
    print("check: " + ", ".join(f"{k_}: {'ok' if v['ok'] else 'FAIL'} (fp8 vs bf16 {v['fp8_rel_err_vs_bf16_linear']:.3f})"
                                for k_, v in res["check"].items()))
    print(f"{'proj':8} {'M':>5} {'bf16 us':>9} {'fp8 us':>9} {'fastacc':>9} {'quant us':>9} {'x':>6} "
          f"{'fp8 TB/s':>8} {'fp8 TF':>7} {'bf16 TF':>7}")
    for name, m, r in rows:
        if "error" in r:
            print(f"{name:8} {m:>5} error {r['error'][:80]}")
            continue
        print(f"{name:8} {m:>5} {r['bf16_us']:9.1f} {r['fp8_us']:9.1f} {r['fp8_fast_accum_us']:9.1f} "
              f"{r['quant_only_us']:9.1f} {r['speedup']:6.2f} {r['fp8_weight_TBps']:8.2f} {r['fp8_TFLOPs']:7.0f} "
              f"{r['bf16_TFLOPs']:7.0f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("verb", choices=["prepare", "run"])
    ap.add_argument("folder", type=Path, nargs="?", default=ROOT / ".kcache" / "fp8_kernels")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/engc_fp8")))
    args = ap.parse_args()
    prepare(args.folder) if args.verb == "prepare" else run(args.folder, args.out)


if __name__ == "__main__":
    main()
