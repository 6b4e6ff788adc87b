"""Check and time the W4A16 kernels (kernels/int4_linear) on an H200 against torch F.linear in bf16.

  python bench/int4_device.py prepare .aot_int4     # here, CPU only: sm90 cubins, default tune + a sweep
  python bench/int4_device.py run .aot_int4         # on the GPU box: cubins through the CUDA driver API

Llama-3-8B projections (qkv, o, gate_up, down) at M in 1, 4, 8, 16, 64, 4096, group size 128. Every case is
checked against the torch reference (dequantize, matmul in float32) before it is timed; the dequant kernel
must match the reference's dequantize bit for bit. Times are medians of CUDA-graph replays over enough
weight copies to miss L2. Per case: the launch rule's path ('int4': the GEMV up to gemv_max_rows, else
dequant + cuBLAS), dequant + cuBLAS at every M (the crossover), the dequant kernel alone, bf16 F.linear.
GB/s counts the int4 weights, scales, zeros, x and y once (the dequant alone: packed in + bf16 out).
The sweep varies GEMV tiles at M=1 and 8 (compiled here) x target_programs, and the dequant tile.
JSON and the log go to $OUT; the table prints last.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

GROUP = 128
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
ROWS = (1, 4, 8, 16, 64, 4096)
GEMV_SWEEP = {  # bucket -> name -> overrides
    "gemv_m1": {"m1n8": dict(BLOCK_N=8), "m1n2": dict(BLOCK_N=2), "m1n4c64w2": dict(BLOCK_C=64, num_warps=2),
                "m1n4c256w8": dict(BLOCK_C=256, num_warps=8), "m1n4c256w4": dict(BLOCK_C=256)},
    "gemv_m8": {"m8n2": dict(BLOCK_N=2), "m8c64w2": dict(BLOCK_C=64, num_warps=2)},
}
DEQUANT_SWEEP = {"dq_n8": dict(BLOCK_N=8), "dq_n2c256w8": dict(BLOCK_N=2, BLOCK_C=256, num_warps=8),
                 "dq_n16c32w1": dict(BLOCK_N=16, BLOCK_C=32, num_warps=1)}
TARGETS = (132, 264)


# ------------------------------------------------------------------------------------------ prepare (CPU)

def prepare(out_dir: Path):
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import int4_linear_specs
    sets = {"default": None}
    for bucket, configs in GEMV_SWEEP.items():
        sets.update({name: {bucket: ov} for name, ov in configs.items()})
    sets.update({name: {"dequant": ov} for name, ov in DEQUANT_SWEEP.items()})
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
        qw = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda", generator=gen)
        s = (torch.rand(n, g, device="cuda", generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
        z = torch.randint(0, 16, (n, g), dtype=torch.uint8, device="cuda", generator=gen)
        out.append((qw, s, z))
    return out


class _Merged:
    """A sweep set's kernels where it has them (the variants it re-tuned), the default set's elsewhere."""

    def __init__(self, first, fallback):
        self.first, self.fallback = first, fallback

    def run(self, op_name, launches):
        for variant, grid, args in launches:
            ks = self.first if (op_name, variant) in self.first.kernels else self.fallback
            ks.kernels[(op_name, variant)](grid, args)


def run(aot: Path, out: Path):
    import torch
    import torch.nn.functional as F
    from kernels_device import KernelSet, rel_err, time_graph
    from engc.kernels import int4_linear as op
    out.mkdir(parents=True, exist_ok=True)
    torch.zeros(1, device="cuda")   # the primary context, before any driver call loads a module
    index = json.loads((aot / "index.json").read_text())
    default = KernelSet(aot / "default", index["default"])
    sets = {name: _Merged(KernelSet(aot / name, recs), default) for name, recs in index.items() if name != "default"}
    sets["default"] = default
    base = {r["variant"]: dict(r["launch"]) for r in index["default"]}
    log_lines, results = [], {"cases": [], "sweep": []}

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    def consts_of(name, target=None):
        consts = dict(base)
        for r in index.get(name, []):
            consts[r["variant"]] = dict(r["launch"])
        if target:
            consts = {v: dict(c, target_programs=target) if v.startswith("gemv_m") else c for v, c in consts.items()}
        return consts

    def linear(ks, consts, x, w, force_dequant=False):
        run = lambda launches: ks.run("int4_linear", launches)  # noqa: E731
        if force_dequant:
            consts = {v: dict(c, gemv_max_rows=0) if v.startswith("gemv_m") else c for v, c in consts.items()}
        return op.run_quantized_linear(x, *w, None, group_size=GROUP, consts=consts, run=run)

    gen = torch.Generator(device="cuda").manual_seed(0)
    t_start = time.time()
    table = []
    for shape, (n, k) in SHAPES.items():
        wbytes = k // 8 * n * 4 + 3 * (k // GROUP) * n
        copies = max(2, math.ceil(200e6 / wbytes))
        weights = make_weights(n, k, copies, gen)
        ref_w = op.dequantize(*weights[0], GROUP)
        dense = [op.dequantize(*weights[i % copies], GROUP) for i in range(max(2, math.ceil(200e6 / (2 * n * k))))]
        scratch = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
        dq_plan = [op.dequant_launch(*weights[i], scratch, group_size=GROUP, consts=base) for i in range(copies)]
        default.run("int4_linear", dq_plan[0])
        dq_exact = torch.equal(scratch, ref_w)
        dq_us = time_graph(lambda i: default.run("int4_linear", dq_plan[i]), copies)
        dq_gbs = (wbytes + 2 * n * k) / dq_us / 1e3
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
            ref = x.float() @ ref_w.float().t()
            y = linear(default, base, x, weights[0])
            err = rel_err(y, ref)
            y2 = linear(default, base, x, weights[0], force_dequant=True)
            err2 = rel_err(y2, ref)
            ok = err < 1e-2 and err2 < 1e-2 and dq_exact
            us = time_graph(lambda i: linear(default, base, x, weights[i]), copies, reps=5 if m > 64 else 20)
            dqc_us = (us if not op.uses_gemv(m, GROUP, base) else
                      time_graph(lambda i: linear(default, base, x, weights[i], force_dequant=True), copies))
            bf16_us = time_graph(lambda i: F.linear(x, dense[i % len(dense)]), len(dense), reps=5 if m > 64 else 20)
            path = "gemv" if op.uses_gemv(m, GROUP, base) else "dequant+cublas"
            row = dict(shape=shape, N=n, K=k, M=m, path=path, rel_err=err, rel_err_dequant_path=err2, ok=ok, us=us,
                       gbs=(wbytes + 2 * m * (k + n)) / us / 1e3, dequant_cublas_us=dqc_us, dequant_us=dq_us,
                       dequant_gbs=dq_gbs, dequant_exact=dq_exact, bf16_us=bf16_us, x_bf16=bf16_us / us)
            results["cases"].append(row)
            table.append(row)
            log(f"{shape} M={m}: {path} err {err:.1e}/{err2:.1e} {'OK' if ok else 'FAIL'} {us:.1f} us "
                f"({row['gbs']:.0f} GB/s) dequant+cuBLAS {dqc_us:.1f} us, bf16 {bf16_us:.1f} us: x{row['x_bf16']:.2f}")
            if m in (1, 8):
                bucket = f"gemv_m{m}"
                for name in ["default", *GEMV_SWEEP[bucket]]:
                    ks = sets[name]
                    for target in TARGETS:
                        consts = consts_of(name, target)
                        yv = linear(ks, consts, x, weights[0])
                        e = rel_err(yv, ref)
                        t = time_graph(lambda i: linear(ks, consts, x, weights[i]), copies)
                        results["sweep"].append(dict(shape=shape, M=m, config=name, target_programs=target, us=t,
                                                     gbs=(wbytes + 2 * m * (k + n)) / t / 1e3, rel_err=e, ok=e < 1e-2))
        for name in DEQUANT_SWEEP:
            ks, consts = sets[name], consts_of(name)
            plan = [op.dequant_launch(*weights[i], scratch, group_size=GROUP, consts=consts) for i in range(copies)]
            scratch.zero_()
            ks.run("int4_linear", plan[0])
            exact = torch.equal(scratch, ref_w)
            t = time_graph(lambda i: ks.run("int4_linear", plan[i]), copies)
            results["sweep"].append(dict(shape=shape, M="dequant", config=name, us=t,
                                         gbs=(wbytes + 2 * n * k) / t / 1e3, ok=exact))
        del weights, dense, scratch
        torch.cuda.empty_cache()
    results["seconds"] = time.time() - t_start
    best = {}
    for r in results["sweep"]:
        key = f"{r['shape']}/M={r['M']}"
        if r["ok"] and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    results["best"] = best
    (out / "int4_results.json").write_text(json.dumps(results, indent=1))
    (out / "int4_log.txt").write_text("\n".join(log_lines))
    print(f"\n===== sweep: best config per shape (the tune table), {results['seconds']:.0f} s =====")
    for key, r in best.items():
        print(f"  {key:18} {r['config']:12} target={r.get('target_programs', '-')!s:5} {r['us']:8.1f} us "
              f"{r['gbs']:6.0f} GB/s")
    print("\n===== int4 g128 vs bf16 F.linear (default tune; dq = dequant + cuBLAS; dequant alone per shape) =====")
    print(f"  {'shape':8} {'M':>5} {'path':14} {'us':>8} {'GB/s':>6} {'dq us':>8} {'bf16 us':>8} {'x bf16':>7} "
          f"{'deq us':>7} {'deq GB/s':>8} check")
    for r in table:
        print(f"  {r['shape']:8} {r['M']:5d} {r['path']:14} {r['us']:8.1f} {r['gbs']:6.0f} {r['dequant_cublas_us']:8.1f} "
              f"{r['bf16_us']:8.1f} {r['x_bf16']:7.2f} {r['dequant_us']:7.1f} {r['dequant_gbs']:8.0f} "
              f"{'OK' if r['ok'] else 'FAIL'}")


if __name__ == "__main__":
    from kernels_device import step_main
    step_main({"prepare": lambda aot, out: prepare(aot), "run": run})
