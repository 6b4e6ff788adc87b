"""Check and time the W4A16 kernels (kernels/int4_linear) on an H200 against torch F.linear in bf16.

  python bench/int4_device.py prepare .aot_int4     # here, CPU only: sm90 cubins, default tune + a sweep
  python bench/int4_device.py run .aot_int4         # on the GPU box: cubins through the CUDA driver API

Llama-3-8B projections (qkv, o, gate_up, down) at M in 1, 4, 8, 16, 64, 4096, group size 128. Each case is
checked against the torch reference (dequantize, matmul in float32) before it is timed; times are medians
of CUDA-graph replays over enough weight copies to miss L2. GB/s counts the int4 weights, scales, zeros,
x and y once. The GEMV sweep varies tile shapes (compiled here) and target_programs (a launch constant,
no compile); the best per shape is printed for tune.py. JSON and the log go to $OUT; a table prints last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

GROUP = 128
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
ROWS = (1, 4, 8, 16, 64, 4096)
GEMV_SWEEP = {"n16r64": dict(BLOCK_N=16, BLOCK_R=64), "n32r32": dict(BLOCK_N=32, BLOCK_R=32),
              "n32r64s2": dict(BLOCK_N=32, BLOCK_R=64, num_stages=2), "n64r32": dict(BLOCK_N=64, BLOCK_R=32),
              "n32r128w8": dict(BLOCK_N=32, BLOCK_R=128, num_warps=8)}
GEMM_SWEEP = {"m64n128k64w4": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
              "m128n256k64w8": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
              "m128n128k128w8": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=2)}
TARGETS = (132, 264, 528, 1056)
SWEEP_ROWS = (1, 8)


# ------------------------------------------------------------------------------------------ prepare (CPU)

def prepare(out_dir: Path):
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import int4_linear_specs
    sets = {"default": None}
    sets.update({k: {f"gemv_m{r}": v for r in SWEEP_ROWS} for k, v in GEMV_SWEEP.items()})
    sets.update({k: {"gemm": v} for k, v in GEMM_SWEEP.items()})
    index = {}
    for name, ov in sets.items():
        specs = int4_linear_specs("bf16", "sm90", (GROUP,), ov)
        if ov:  # only the kernels the override changes
            specs = [s for s in specs if any(s.tune_key.endswith(f"/{b}+override") for b in ov)]
        t0 = time.time()
        res = compile_specs(specs, progress=None, jobs=2)
        print(f"{name}: {len(specs)} kernels in {time.time() - t0:.1f}s", flush=True)
        for path, data in res.files.items():
            dst = out_dir / name / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
        index[name] = res.records
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))


# ------------------------------------------------------------------------------------------ run (GPU)

def make_weights(n, k, copies, gen):
    import torch
    g = k // GROUP
    out = []
    for _ in range(copies):
        qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda", generator=gen)
        s = (torch.rand(g, n, device="cuda", generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
        z = torch.randint(0, 16, (g, n), dtype=torch.uint8, device="cuda", generator=gen)
        out.append((qw, s, z))
    return out


def run(aot: Path, out: Path):
    import torch
    import torch.nn.functional as F
    from kernels_device import KernelSet, rel_err, time_graph
    from engc.kernels import int4_linear as op
    out.mkdir(parents=True, exist_ok=True)
    torch.zeros(1, device="cuda")   # the primary context, before any driver call loads a module
    index = json.loads((aot / "index.json").read_text())
    sets = {name: KernelSet(aot / name, recs) for name, recs in index.items()}
    default = sets["default"]
    base_consts = {r["variant"]: dict(r["launch"]) for r in index["default"]}
    log_lines, results = [], {"cases": [], "gemv_sweep": [], "gemm_sweep": []}

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    gen = torch.Generator(device="cuda").manual_seed(0)
    t_start = time.time()
    table = []
    for shape, (n, k) in SHAPES.items():
        wbytes = k // 8 * n * 4 + 3 * (k // GROUP) * n
        copies = max(2, math.ceil(200e6 / wbytes))
        weights = make_weights(n, k, copies, gen)
        dense = [op.dequantize(*weights[i], GROUP).to(torch.bfloat16).t().contiguous()
                 for i in range(max(2, math.ceil(200e6 / (2 * n * k))))]
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
            ys = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]

            def launches(consts, i):
                return op.launch(x, *weights[i], None, ys[i], group_size=GROUP, consts=consts)

            ks = default
            plan = [launches(base_consts, i) for i in range(copies)]
            ks.run("int4_linear", plan[0])
            ref = (x.float() @ op.dequantize(*weights[0], GROUP).float())
            err = rel_err(ys[0], ref)
            us = time_graph(lambda i: ks.run("int4_linear", plan[i]), copies)
            dense_us = time_graph(lambda i: F.linear(x, dense[i % len(dense)]), len(dense))
            nbytes = wbytes + 2 * m * (k + n)
            row = dict(shape=shape, N=n, K=k, M=m, kernel=plan[0][0][0], rel_err=err, ok=err < 1e-2, us=us,
                       gbs=nbytes / us / 1e3, bf16_us=dense_us, speedup_vs_bf16=dense_us / us,
                       tflops=2 * m * n * k / us / 1e6)
            results["cases"].append(row)
            table.append(row)
            log(f"{shape} M={m}: {row['kernel']} err {err:.1e} {'OK' if row['ok'] else 'FAIL'} {us:.1f} us "
                f"({row['gbs']:.0f} GB/s, {row['tflops']:.0f} TFLOP/s) vs bf16 {dense_us:.1f} us: "
                f"x{row['speedup_vs_bf16']:.2f}")
            if m in SWEEP_ROWS:  # GEMV tiles x target_programs
                for name in ["default", *GEMV_SWEEP]:
                    consts = dict(base_consts)
                    for r in index[name]:
                        consts[r["variant"]] = dict(r["launch"])
                    for target in TARGETS:
                        for v in consts:
                            if v.startswith("gemv_m"):
                                consts[v] = dict(consts[v], target_programs=target)
                        p = [launches(consts, i) for i in range(copies)]
                        kset = sets[name] if name != "default" else default
                        merged = _Merged(kset, default)
                        merged.run("int4_linear", p[0])
                        e = rel_err(ys[0], ref)
                        t = time_graph(lambda i: merged.run("int4_linear", p[i]), copies)
                        results["gemv_sweep"].append(dict(shape=shape, M=m, config=name, target_programs=target,
                                                          us=t, gbs=nbytes / t / 1e3, rel_err=e, ok=e < 1e-2))
            if m == 4096:
                for name in GEMM_SWEEP:
                    consts = dict(base_consts)
                    for r in index[name]:
                        consts[r["variant"]] = dict(r["launch"])
                    p = [launches(consts, i) for i in range(copies)]
                    merged = _Merged(sets[name], default)
                    merged.run("int4_linear", p[0])
                    e = rel_err(ys[0], ref)
                    t = time_graph(lambda i: merged.run("int4_linear", p[i]), copies, reps=5)
                    results["gemm_sweep"].append(dict(shape=shape, config=name, us=t, tflops=2 * m * n * k / t / 1e6,
                                                      vs_bf16=dense_us / t, rel_err=e, ok=e < 1e-2))
            del ys
        del weights, dense
        torch.cuda.empty_cache()
    results["seconds"] = time.time() - t_start
    best = {}
    for r in results["gemv_sweep"]:
        key = f"{r['shape']}/M={r['M']}"
        if r["ok"] and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    for r in results["gemm_sweep"]:
        key = f"{r['shape']}/M=4096"
        if r["ok"] and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    results["best"] = best
    (out / "int4_results.json").write_text(json.dumps(results, indent=1))
    (out / "int4_log.txt").write_text("\n".join(log_lines))
    print("\n===== best configs (tune.py) =====")
    for key, r in best.items():
        extra = f"target_programs={r['target_programs']}" if "target_programs" in r else f"{r['tflops']:.0f} TFLOP/s"
        print(f"  {key:18} {r['config']:16} {extra:22} {r['us']:.1f} us")
    print("\n===== int4 g128 vs bf16 F.linear (default tune) =====")
    print(f"  {'shape':8} {'M':>5} {'kernel':12} {'us':>8} {'GB/s':>6} {'bf16 us':>8} {'x bf16':>7} check")
    for r in table:
        print(f"  {r['shape']:8} {r['M']:5d} {r['kernel'][:12]:12} {r['us']:8.1f} {r['gbs']:6.0f} {r['bf16_us']:8.1f} "
              f"{r['speedup_vs_bf16']:7.2f} {'OK' if r['ok'] else 'FAIL'}")


class _Merged:
    """A sweep set's kernels where it has them (the variants it re-tuned), the default set's elsewhere."""

    def __init__(self, first, fallback):
        self.first, self.fallback = first, fallback

    def run(self, op_name, launches):
        for variant, grid, args in launches:
            ks = self.first if (op_name, variant) in self.first.kernels else self.fallback
            ks.kernels[(op_name, variant)](grid, args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["prepare", "run"])
    ap.add_argument("aot", type=Path)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = ap.parse_args()
    prepare(args.aot) if args.step == "prepare" else run(args.aot, args.out)


if __name__ == "__main__":
    main()
