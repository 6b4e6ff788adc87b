#!/usr/bin/env python3
"""FP8 W8A8 projections on the H200: the bundle's fp8_linear GEMM (kernels/fp8_linear) and the per-token
quant kernel + torch._scaled_mm, against bf16 F.linear.

Two steps, two machines:
  python bench/fp8_device.py prepare .kcache/fp8_kernels    # here, CPU only: AOT-compile for sm90 (~2 min)
  python bench/fp8_device.py run .kcache/fp8_kernels        # on the GPU (no Triton): check, then time (<60 s)

The kernels are loaded from their cubins through engc._native, and FP8Linear runs through runtime/gpu_ops.py's
own binding (fused x quant for the smallest M class, fp8_quant + fp8_linear up to 256 rows, fp8_quant +
_scaled_mm above). Shapes: the Llama-3-8B decoder projections (qkv, o, gate_up, down) at M in {1, 32, 64, 256}.
Each timing is a CUDA graph of 20 calls cycling over enough weight copies that no call finds its weight
in L2 (as in a decode step, where each layer's weights are read once), fastest of 5 replays, after a
second of bf16 GEMMs that brings the clocks up (v2 timed the same config 19.5 and 15.4 us a minute apart).
The sweep: fp8_linear alone at M=32 and M=64 over BLOCK_N 32/64/128 x BLOCK_K 128/256 x stages 3-6 x
warps 4/8 (the compiled variants '<table variant>@n..k..s..w..', those whose shared memory fits an SM)
x target_programs 1/2/3/4 x SMs (a launch constant: no recompile; a target giving a grid already timed is
skipped), each variant checked against the reference first. It prints the best per projection and per
(K, M class) (the sum over the projections of that K, as a layer runs them) with the tune table line.
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
ROWS = (1, 32, 64, 256)
CALLS = 20


# fp8_linear configs swept at M=32 and M=64 (classes m<=32, m<=64): tag -> tune overrides. BLOCK_N 32 is
# below wgmma's 64 rows (Triton falls back to mma.sync with fp8 -> f16 conversions): 4 warps only.
SWEEP_CLASSES = {32: "m<=32", 64: "m<=64"}
SWEEP_TARGETS = (1, 2, 3, 4)            # target_programs, in multiples of the SM count
SMEM_PER_SM = 227 * 1024                # an H100/H200 program's shared-memory limit


def sweep_configs(block_m: int) -> dict:
    out = {}
    for bn in (32, 64, 128):
        for bk in (128, 256):
            for stages in (3, 4, 5, 6):
                for warps in ((4,) if bn == 32 else (4, 8)):
                    if stages * (bn + block_m) * bk <= SMEM_PER_SM:   # W + x tiles per stage
                        out[f"n{bn}k{bk}s{stages}w{warps}"] = dict(BLOCK_N=bn, BLOCK_K=bk, num_stages=stages,
                                                                   num_warps=warps)
    return out


def _llama8b():
    from engc.bundle.model_config import ModelConfig
    return ModelConfig(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
                       max_position_embeddings=8192, tie_word_embeddings=False)


def prepare(out: Path):
    import dataclasses
    from engc.compiler.codegen.record import compile_specs, default_jobs
    from engc.compiler.codegen.decode_gemm_specs import fp8_linear_specs
    from engc.compiler.codegen.specs import fp8_quant_specs
    cfg = _llama8b()
    t = time.time()
    specs = fp8_quant_specs(cfg, "bf16", "sm90") + fp8_linear_specs(cfg, "bf16", "sm90")
    for m, cls in SWEEP_CLASSES.items():   # same kernel, other constants: variant '<table variant>@<tag>'
        for tag, ov in sweep_configs(m).items():
            specs += [dataclasses.replace(s, variant=f"{s.variant}@{tag}")
                      for s in fp8_linear_specs(cfg, "bf16", "sm90", {cls: ov}, classes=(cls,))]
    result = compile_specs(specs, jobs=default_jobs())
    result.records = [r for r in result.records if r["shared_mem"] <= SMEM_PER_SM]
    for rel, data in result.files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    (out / "records.json").write_text(json.dumps(result.records, indent=1, sort_keys=True))
    print(f"{len(result.records)} fp8_quant/fp8_linear kernels for sm90 in {time.time() - t:.1f}s -> {out}")


class Kernels:
    """The cubins, loaded and launched the way runtime/gpu_ops.py's BundleKernels does; sweep variants
    ('...@tag') are kept out of consts, so the runtime binding sees the bundle's own table."""

    def __init__(self, folder: Path):
        from engc.cuda.cubin import load_kernel, signature_from_triton
        self.kernels, self.consts, self.all_consts = {}, {}, {}
        for r in json.loads((folder / "records.json").read_text()):
            sig = signature_from_triton([a["type"] for a in r["args"][:-2]])
            self.kernels[(r["op"], r["variant"])] = load_kernel(
                (folder / r["cubin"]).read_bytes(), r["entry"], sig, block_x=32 * r["num_warps"],
                shared_mem=r["shared_mem"], scratch_params=2)
            self.all_consts.setdefault(r["op"], {})[r["variant"]] = r.get("launch", {})
            if "@" not in r["variant"]:
                self.consts.setdefault(r["op"], {})[r["variant"]] = r.get("launch", {})

    def run(self, op, launches):
        from engc.cuda.cubin import current_stream
        for variant, grid, args in launches:
            kernel = self.kernels[(op, variant)]
            kernel.launch(grid, [a.data_ptr() if hasattr(a, "data_ptr") else a for a in args[:len(kernel.signature)]],
                          current_stream())


def fp8_linear(k: Kernels, x, w, w_scale, fast_accum=False):
    """fp8_quant + _scaled_mm: the path before fp8_linear (and still the one above its M classes)."""
    import torch
    from engc.kernels import fp8_quant
    xq = torch.empty(x.shape, dtype=fp8_quant.FP8, device=x.device)
    xs = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    k.run("fp8_quant", fp8_quant.launch(x, xq, xs))
    return torch._scaled_mm(xq, w.t(), scale_a=xs[:, None], scale_b=w_scale[None, :], out_dtype=x.dtype,
                            use_fast_accum=fast_accum)


def gemm_only(k: Kernels, variant, xq, xs, w, ws, counters, consts=None):
    """fp8_linear alone on already-quantized x: the weight-streaming rate of the kernel. consts: the
    variant's launch constants (default: its record's)."""
    import torch
    from engc.kernels import fp8_linear as fp8_gemm
    out = torch.empty(xq.shape[0], w.shape[0], dtype=torch.bfloat16, device=xq.device)
    k.run("fp8_linear", fp8_gemm.launch(xq, xs, w, ws, None, out, variant,
                                        consts or k.all_consts["fp8_linear"][variant], counters))
    return out


def sweep(k: Kernels, plain, xq, xs, w8, counters) -> dict:
    """'tag/t<mult>' -> {us, splits, programs} (or {error}) for every compiled config of the table variant
    `plain` (tag 'table': the variant itself) and target_programs = mult x SMs; each config checked first
    against the reference at its deepest split, a target giving a grid already timed is not timed again."""
    import torch
    from engc.kernels import fp8_linear as fp8_gemm
    from engc.kernels.fp8_quant import dequantize_rows
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    (n, kdim), copies = w8[0][0].shape, len(w8)
    ref = dequantize_rows(xq, xs) @ dequantize_rows(*w8[0]).t()
    out = {}
    for v in [plain] + sorted(v for v in k.all_consts["fp8_linear"] if v.startswith(plain + "@")):
        tag, c0 = (v.split("@")[1] if "@" in v else "table"), k.all_consts["fp8_linear"][v]
        n_tiles, k_tiles = -(-n // c0["BLOCK_N"]), -(-kdim // c0["BLOCK_K"])
        deepest = dict(c0, target_programs=max(SWEEP_TARGETS) * sms)
        err = float((gemm_only(k, v, xq, xs, *w8[0], counters, deepest).float() - ref).norm() / ref.norm())
        if not err < 1e-2 or int(counters.abs().sum()) != 0:
            out[f"{tag}/t*"] = {"error": f"rel err {err:.3g}, counters left {int(counters.abs().sum())}"}
            counters.zero_()
            continue
        timed = {}
        for mult in SWEEP_TARGETS:
            c = dict(c0, target_programs=mult * sms)
            splits = fp8_gemm.split_count(n_tiles, k_tiles, c)[0]
            if splits not in timed:
                timed[splits] = {"us": graph_time(lambda i: gemm_only(k, v, xq, xs, *w8[i % copies], counters, c))
                                 * 1e6, "splits": splits, "programs": n_tiles * splits}
            out[f"{tag}/t{mult}"] = timed[splits]
    return out


def best_per_k_class(sweeps: dict) -> dict:
    """(K, M) -> (config/target, summed us, per projection us): the config whose time summed over the
    projections of that input width (as one layer runs them) is least."""
    best = {}
    for m in SWEEP_CLASSES:
        for kdim in sorted({kd for _, kd in PROJECTIONS.values()}):
            names = [p for p, (_, kd) in PROJECTIONS.items() if kd == kdim and f"{p}_m{m}" in sweeps]
            if not names:
                continue
            keys = set.intersection(*({key for key, r in sweeps[f"{p}_m{m}"].items() if "splits" in r}
                                      for p in names))
            if keys:
                total = {key: sum(sweeps[f"{p}_m{m}"][key]["us"] for p in names) for key in keys}
                key = min(total, key=total.get)
                best[f"k{kdim}_m{m}"] = {"config": key, "sum_us": total[key], "table_sum_us": min(
                    (v for kk, v in total.items() if kk.startswith("table/")), default=None),
                    "per_projection": {p: sweeps[f"{p}_m{m}"][key]["us"] for p in names}}
    return best


def tune_line(kdim: int, m: int, config: str) -> str:
    """The tune table entry for a sweep winner 'n128k128s4w8/t2' (per K: variant k<K>_m<M> wins over '*')."""
    tag, target = config.split("/")
    if tag == "table":
        return f"# k{kdim}_m{m}: the table's own entry with target_programs={target[1:]} x SMs"
    bn, bk, st, wp = (int(x) for x in tag[1:].replace("k", " ").replace("s", " ").replace("w", " ").split())
    return (f'put("sm90", "fp8_linear", "k{kdim}_m{m}", "m<={m}", max_m={m}, BLOCK_M={m}, BLOCK_N={bn}, '
            f'BLOCK_K={bk}, num_warps={wp}, num_stages={st}, target_programs={target[1:]} * SM_COUNT["sm90"], '
            f'max_splits=16, min_split_k_tiles=4)')


def warm_clocks(seconds=1.0):
    """Keep the GPU busy for a while so the timings start at steady clocks."""
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time.time()
    while time.time() - t < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def graph_time(fn, calls=CALLS, replays=5) -> float:
    """Fastest seconds per call of fn(i) over a CUDA graph of `calls` calls (noise only adds time)."""
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
    return min(times)


def check(k: Kernels, op, counters) -> dict:
    """The quant kernel bit for bit against quantize_rows on the CPU; FP8Linear through the runtime binding
    (each path: fused quant, quant + fp8_linear, quant + _scaled_mm) and every fp8_linear variant against
    the op's reference on the same codes, in fp32 on the GPU."""
    import torch
    import torch.nn.functional as F
    from engc.kernels.fp8_quant import dequantize_rows, launch, quantize_rows
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, (n, kdim) in PROJECTIONS.items():
        w = (torch.randn(n, kdim, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        wq, ws = quantize_rows(w)
        w_ref = dequantize_rows(wq, ws)
        for m in (3, 67, 300):   # fused-quant class, the m<=128 class, above every class (_scaled_mm)
            x = torch.randn(m, kdim, device="cuda", generator=g).to(torch.bfloat16)
            x[1] = 0
            x[2] *= 1e3
            xq = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
            xs = torch.empty(m, device="cuda")
            k.run("fp8_quant", launch(x, xq, xs))
            rq, rs = (t.cuda() for t in quantize_rows(x.cpu()))
            ref = dequantize_rows(rq, rs) @ w_ref.t()
            rel = lambda y: float((y.float() - ref).norm() / ref.norm())  # noqa: E731
            r = {"quant_codes_differing": int((xq.view(torch.uint8) != rq.view(torch.uint8)).sum()),
                 "quant_scales_differing": int((xs != rs).sum()),
                 "op_rel_err": rel(op(x, wq, ws)[0]),
                 "fp8_vs_bf16_linear": float((ref - F.linear(x, w).float()).norm() / ref.norm())}
            variants = [v for v, c in k.consts["fp8_linear"].items() if c["K"] == kdim and m <= c["max_m"]]
            r["variants_rel_err"] = {v: rel(gemm_only(k, v, x if k.all_consts["fp8_linear"][v]["QUANT_X"] else xq,
                                                     None if k.all_consts["fp8_linear"][v]["QUANT_X"] else xs,
                                                     wq, ws, counters)) for v in variants}
            # bf16 output (2^-9 relative rounding), accumulation order: 1e-2 is generous for the GEMMs; the
            # e4m3 rounding of both operands puts fp8 at ~3.7% of bf16 F.linear (a sanity bound, not a check)
            r["ok"] = (r["quant_codes_differing"] == 0 and r["quant_scales_differing"] == 0
                       and r["op_rel_err"] < 1e-2 and all(e < 1e-2 for e in r["variants_rel_err"].values())
                       and r["fp8_vs_bf16_linear"] < 0.06 and int(counters.abs().sum()) == 0)
            out[f"{name}_m{m}"] = r
    return out


def run(folder: Path, out_dir: Path):
    import torch
    import torch.nn.functional as F
    from engc.bundle.program import ENGC_DOMAIN
    from engc.kernels import fp8_linear as fp8_gemm
    from engc.kernels import fp8_quant
    from engc.kernels.fp8_quant import quantize_rows
    from engc.runtime.gpu_ops import StepFacts, gpu_ops
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    k = Kernels(folder)
    op = gpu_ops(k, StepFacts())[(ENGC_DOMAIN, "FP8Linear")]   # the runtime's FP8Linear binding
    counters = torch.zeros(fp8_gemm.NUM_COUNTERS, dtype=torch.int32, device="cuda")
    table = fp8_gemm.variant_table(k.consts["fp8_linear"])
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "check": check(k, op, counters),
           "timings": {}, "sweep": {}}
    bad = [c for c, v in res["check"].items() if not v["ok"]]
    print(f"check: {'ok' if not bad else 'FAIL ' + str(bad)} ({time.time() - t0:.1f} s)", flush=True)
    warm_clocks()
    rows = []
    for name, (n, kdim) in PROJECTIONS.items():
        copies = max(2, -(-400_000_000 // (n * kdim * 2)))  # > 400 MB of bf16 weights cycle: none stays in L2
        w16 = [(torch.randn(n, kdim, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
        w8 = [quantize_rows(w) for w in w16]
        for m in ROWS:
            x = torch.randn(m, kdim, device="cuda").to(torch.bfloat16)
            xq = torch.empty(m, kdim, dtype=fp8_quant.FP8, device="cuda")
            xs = torch.empty(m, device="cuda")
            k.run("fp8_quant", fp8_quant.launch(x, xq, xs))
            plain = fp8_gemm.pick(table, kdim, m, quant_x=False)
            r = {"plain_variant": plain, "fused_variant": fp8_gemm.pick(table, kdim, m, quant_x=True)}
            try:
                r["bf16_us"] = graph_time(lambda i: F.linear(x, w16[i % copies])) * 1e6
                r["scaled_mm_us"] = graph_time(lambda i: fp8_linear(k, x, *w8[i % copies])) * 1e6
                r["quant_only_us"] = graph_time(lambda i: k.run("fp8_quant", fp8_quant.launch(x, xq, xs))) * 1e6
                r["op_us"] = graph_time(lambda i: op(x, *w8[i % copies])) * 1e6
                r["speedup_vs_bf16"] = r["bf16_us"] / r["op_us"]
                if plain is None:   # above the GEMM's M classes: the runtime takes fp8_quant + _scaled_mm
                    res["timings"][f"{name}_m{m}"] = r
                    rows.append((name, m, r))
                    continue
                r["gemm_us"] = graph_time(lambda i: gemm_only(k, plain, xq, xs, *w8[i % copies], counters)) * 1e6
                r["quant_gemm_us"] = graph_time(lambda i: (k.run("fp8_quant", fp8_quant.launch(x, xq, xs)),
                                                           gemm_only(k, plain, xq, xs, *w8[i % copies], counters)))
                r["quant_gemm_us"] *= 1e6
                r["gemm_weight_TBps"] = n * kdim / (r["gemm_us"] * 1e-6) / 1e12
                if m in SWEEP_CLASSES:
                    res["sweep"][f"{name}_m{m}"] = sweep(k, plain, xq, xs, w8, counters)
                    res["sweep"][f"{name}_m{m}"]["table(again)"] = {"us": graph_time(
                        lambda i: gemm_only(k, plain, xq, xs, *w8[i % copies], counters)) * 1e6}  # drift
            except Exception as e:  # report and go on
                r["error"] = repr(e)[:300]
            res["timings"][f"{name}_m{m}"] = r
            rows.append((name, m, r))
        del w16, w8
        torch.cuda.empty_cache()
    res["best_per_k_class"] = best_per_k_class(res["sweep"])
    res["seconds"] = round(time.time() - t0, 1)
    (out_dir / "fp8_kernels.json").write_text(json.dumps(res, indent=1))
    print(f"\n===== fp8 projections on {res['gpu']} (torch {res['torch']}), {res['seconds']} s =====")
    print(f"check ({len(res['check'])} shape x M, every table variant): " + ("ok" if not bad else f"FAIL {bad}"))
    print("sweep, fp8_linear alone (us; config/t<target_programs in SMs>; table = the tune table's entry, "
          "timed again at the end):")
    for key, v in res["sweep"].items():
        ok = {c: r for c, r in v.items() if "splits" in r}
        failed = [c for c, r in v.items() if "error" in r]
        if not ok:
            print(f"  {key:12} no config passed the check {failed[:3]}")
            continue
        b = min(ok, key=lambda c: ok[c]["us"])
        table = min((r["us"] for c, r in ok.items() if c.startswith("table/")), default=float("nan"))
        n, kdim = PROJECTIONS[key.rsplit("_m", 1)[0]]
        print(f"  {key:12} best {b:18} {ok[b]['us']:6.1f} ({n * kdim / ok[b]['us'] / 1e6:4.2f} TB/s, "
              f"{ok[b]['programs']} programs)  table {table:6.1f}, again {v['table(again)']['us']:6.1f}"
              + (f"  FAILED {failed}" if failed else ""))
    print("best per (K, M class), summed over that K's projections -> the tune table:")
    for key, b in res["best_per_k_class"].items():
        print(f"  {key}: {b['config']} {b['sum_us']:.1f} us (table {b['table_sum_us']:.1f}) "
              + ", ".join(f"{p} {u:.1f}" for p, u in b["per_projection"].items()))
        kdim, m = (int(x) for x in key[1:].split("_m"))
        print("    " + tune_line(kdim, m, b["config"]))
    print("us per call. op: the runtime's FP8Linear (fused quant for m<=16, else fp8_quant + fp8_linear); "
          "sm+q: fp8_quant + _scaled_mm;\nq+gemm: fp8_quant + fp8_linear; gemm: fp8_linear alone; x bf16: op vs bf16")
    print(f"{'proj':8} {'M':>4} {'bf16':>7} {'sm+q':>7} {'op':>7} {'q+gemm':>7} {'gemm':>7} {'quant':>6} "
          f"{'x bf16':>7} {'gemm TB/s':>9}")
    for name, m, r in rows:
        if "error" in r:
            print(f"{name:8} {m:>4} error {r['error'][:80]}")
            continue
        nan = float("nan")   # no GEMM columns above its M classes
        print(f"{name:8} {m:>4} {r['bf16_us']:7.1f} {r['scaled_mm_us']:7.1f} {r['op_us']:7.1f} "
              f"{r.get('quant_gemm_us', nan):7.1f} {r.get('gemm_us', nan):7.1f} "
              f"{r['quant_only_us']:6.1f} {r['speedup_vs_bf16']:7.2f} {r.get('gemm_weight_TBps', nan):9.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("verb", choices=["prepare", "run"])
    ap.add_argument("folder", type=Path, nargs="?", default=ROOT / ".kcache" / "fp8_kernels")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/engc_fp8")))
    args = ap.parse_args()
    prepare(args.folder) if args.verb == "prepare" else run(args.folder, args.out)


if __name__ == "__main__":
    main()
