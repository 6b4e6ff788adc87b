#!/usr/bin/env python3
"""The skinny bf16 GEMM (kernels/skinny_gemm) against cuBLAS on an H200, at decode batches of 16-64 rows.

Two steps, two machines:
  python bench/skinny_gemm_device.py prepare .sg_aot   # here, CPU only: AOT-compile a config grid for sm90
  python bench/skinny_gemm_device.py run .sg_aot       # on the GPU (no Triton): check, then time; JSON to $OUT

Shapes: the Llama-3-8B projections (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, SiLU-fused down
14336->4096, lm_head 4096->128256) and the Llama-3.2-1B ones (qkv 2048->3072, o 2048->2048, gate_up
2048->16384, down 8192->2048) at M = 16, 32, 64 (the classes m<=16, m<=32, m<=64). Kernels are loaded from
their cubins through engc.cuda.cubin (engc._native), as the runtime does. Every config is first checked
against the fp32 torch reference at a ragged M (class max - 3) and at its deepest split-K (counters must
come back zero); only configs that pass are timed. Each timing is a CUDA graph of 20 calls cycling over
enough weight copies (> 400 MB) that no call finds its weight in L2, fastest of 5 replays, after a second
of GEMMs that brings the clocks up. cuBLAS is F.linear; for the SiLU-fused down it is what the runtime
runs without this kernel: the bundle's silu_mul kernel + F.linear. Configs are timed launched plainly; the
best one per shape is timed again with PDL (as the runtime launches it on sm90: its L2 prefetch of W then
overlaps the previous launch's tail; here that launch is the same GEMM, in a step it is a norm or the
attention). target_programs 1x and 2x SMs is a launch constant (no recompile). The last lines: per shape and
M, cuBLAS us, the best config's us (plain and PDL), speedup, weight TB/s; then an 8B decode step at M=32
(4 projections x 32 layers + lm_head) with cuBLAS, with the best configs, and with the better of the two
per projection.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
               num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
               num_kv_heads=8, head_dim=64, tie_word_embeddings=True),
}
SHAPES = {  # name -> (N, K, silu)
    "8b.qkv": (6144, 4096, False), "8b.o": (4096, 4096, False), "8b.gate_up": (28672, 4096, False),
    "8b.down": (4096, 14336, True), "8b.lm_head": (128256, 4096, False),
    "1b.qkv": (3072, 2048, False), "1b.o": (2048, 2048, False), "1b.gate_up": (16384, 2048, False),
    "1b.down": (2048, 8192, True),
}
ROWS = {16: "m<=16", 32: "m<=32", 64: "m<=64"}   # timed M -> the class (tune bucket) that serves it
TARGETS = (1, 2)                                  # target_programs in SMs
CALLS = 20
SMEM_PER_SM = 227 * 1024
# tag -> tune overrides, compiled for every class ('table' is the class's own entry); W + x tiles per stage
# must fit the shared memory (checked on the compiled kernel: the SiLU variant stages gate and up tiles)
CONFIGS = {
    "table": {},
    "n64k128s4w4": dict(BLOCK_N=64, BLOCK_K=128, num_stages=4, num_warps=4),
    "n64k256s4w4": dict(BLOCK_N=64, BLOCK_K=256, num_stages=4, num_warps=4),
    "n64k256s3w8": dict(BLOCK_N=64, BLOCK_K=256, num_stages=3, num_warps=8),
    "n128k128s4w8": dict(BLOCK_N=128, BLOCK_K=128, num_stages=4, num_warps=8),
    "n128k64s6w4": dict(BLOCK_N=128, BLOCK_K=64, num_stages=6, num_warps=4),
    "n64k64s8w4": dict(BLOCK_N=64, BLOCK_K=64, num_stages=8, num_warps=4),
    "nopf": dict(PREFETCH_K=0),                  # the table's tile without the L2 prefetch
}


def _cfg(model: str):
    from engc.bundle.model_config import ModelConfig
    return ModelConfig(family="llama", rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=131072,
                       **MODELS[model])


# ------------------------------------------------------------------------------------------ prepare (CPU)

def prepare(out: Path):
    from engc.compiler.codegen.record import compile_specs, default_jobs
    from engc.compiler.codegen.decode_gemm_specs import skinny_gemm_specs
    from engc.compiler.codegen.specs import silu_mul_specs
    t0 = time.time()
    specs = []
    for model in MODELS:
        cfg = _cfg(model)
        specs += [dataclasses.replace(s, variant=f"{s.variant}@{model}") for s in silu_mul_specs(cfg, "bf16", "sm90")]
        for cls in ROWS.values():
            for tag, ov in CONFIGS.items():
                for s in skinny_gemm_specs(cfg, "bf16", "sm90", {cls: ov} if ov else None, classes=(cls,),
                                           enabled_only=False):
                    specs.append(dataclasses.replace(s, variant=f"{s.variant}@{tag}"))
    result = compile_specs(specs, jobs=default_jobs())
    records = [r for r in result.records if r["shared_mem"] <= SMEM_PER_SM]
    for r in records:   # cubins only: the PTX and sources stay here (the folder is carried to the device)
        (out / r["cubin"]).parent.mkdir(parents=True, exist_ok=True)
        (out / r["cubin"]).write_bytes(result.files[r["cubin"]])
    (out / "records.json").write_text(json.dumps(records, indent=1, sort_keys=True))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{len(records)} kernels for sm90 ({len(result.records) - len(records)} over the shared memory "
          f"dropped) in {time.time() - t0:.0f} s -> {out} ({size / 2**20:.1f} MiB)")


# ------------------------------------------------------------------------------------------ run (GPU)

class Kernels:
    """The cubins, loaded the way runtime/gpu_ops.py's BundleKernels loads them; each twice, launched
    plainly and with PDL."""

    def __init__(self, folder: Path):
        from engc.cuda.cubin import load_kernel, signature_from_triton
        self.kernels, self.consts = {}, {}
        for r in json.loads((folder / "records.json").read_text()):
            sig = signature_from_triton([a["type"] for a in r["args"][:-2]])
            image = (folder / r["cubin"]).read_bytes()
            for pdl in (False, True):
                self.kernels[(r["variant"], pdl)] = load_kernel(
                    image, r["entry"], sig, block_x=32 * r["num_warps"], shared_mem=r["shared_mem"],
                    scratch_params=2, pdl=pdl and bool(r["launch"].get("PDL")))
            self.consts[r["variant"]] = r["launch"]

    def run(self, launches, pdl=False):
        from engc.cuda.cubin import current_stream
        for variant, grid, args in launches:
            kernel = self.kernels[(variant, pdl)]
            kernel.launch(grid, [a.data_ptr() if hasattr(a, "data_ptr") else a for a in args[:len(kernel.signature)]],
                          current_stream())


def warm_clocks(seconds=1.0):
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time.time()
    while time.time() - t < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def graph_time(fn, calls=CALLS, replays=5) -> float:
    """Fastest us per call of fn(i) over a CUDA graph of `calls` calls (noise only adds time)."""
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
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return min(times)


def run(folder: Path, out_dir: Path):
    import torch
    import torch.nn.functional as F
    from engc.kernels import silu_mul, skinny_gemm
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    k = Kernels(folder)
    counters = torch.zeros(skinny_gemm.NUM_COUNTERS, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    warm_clocks()

    def gemm(variant, x, w, consts, pdl=False):
        out = torch.empty(x.shape[0], w.shape[0], dtype=bf, device="cuda")
        k.run(skinny_gemm.launch(x, w, out, variant, consts, counters), pdl)
        return out

    def act(model, gate_up):   # the bundle's silu_mul kernel, as the runtime's fallback runs it
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=bf, device="cuda")
        launches = silu_mul.launch(gate_up, out, {"default": k.consts[f"default@{model}"]})
        k.run([(f"{v}@{model}", grid, args) for v, grid, args in launches])
        return out

    for shape, (n, kdim, silu) in SHAPES.items():
        model = shape.split(".")[0]
        copies = max(2, -(-400_000_000 // (n * kdim * 2)))
        ws = [(torch.randn(n, kdim, device="cuda", generator=g) * kdim ** -0.5).to(bf) for _ in range(copies)]
        for m, cls in ROWS.items():
            key, r = f"{shape}_m{m}", {"configs": {}}
            res["shapes"][key] = r
            x = torch.randn(m, 2 * kdim if silu else kdim, device="cuda", generator=g).to(bf)
            cub = (lambda i: F.linear(act(model, x), ws[i % copies])) if silu else (lambda i: F.linear(x, ws[i % copies]))
            r["cublas_us"] = graph_time(cub)
            if silu:
                xa = silu_mul.silu_mul(x)
                r["cublas_linear_only_us"] = graph_time(lambda i: F.linear(xa, ws[i % copies]))
            # the check: a ragged M of the class, fp32 reference of the same bf16 activation
            mc = m - 3
            xc = x[:mc].contiguous()
            ref = (silu_mul.silu_mul(xc) if silu else xc).float() @ ws[0].float().t()
            prefix = f"{skinny_gemm.variant_name(kdim, silu, m)}@"
            for variant in sorted(v for v in k.consts if v.startswith(prefix)):
                c0, tag = k.consts[variant], variant.split("@")[1]
                n_tiles, k_tiles = -(-n // c0["BLOCK_N"]), -(-kdim // c0["BLOCK_K"])
                deep = dict(c0, target_programs=8 * sms)   # the deepest split the rule allows
                try:
                    err = float((gemm(variant, xc, ws[0], deep).float() - ref).norm() / ref.norm())
                except Exception as e:   # reported with the config; the others still run
                    r["configs"][tag] = {"error": repr(e)[:200]}
                    continue
                left = int(counters.abs().sum())
                if not err < 1e-2 or left:
                    r["configs"][tag] = {"error": f"rel err {err:.3g}, counters left {left}"}
                    counters.zero_()
                    continue
                timed = {}   # splits -> result: a target giving a grid already timed is not timed again
                for mult in TARGETS:
                    c = dict(c0, target_programs=mult * sms)
                    splits = skinny_gemm.split_count(n_tiles, k_tiles, c)[0]
                    if splits not in timed:
                        timed[splits] = {"us": graph_time(lambda i: gemm(variant, x, ws[i % copies], c)),
                                         "splits": splits, "programs": n_tiles * splits, "rel_err": err}
                    r["configs"][f"{tag}/t{mult}"] = timed[splits]
            ok = {c: v for c, v in r["configs"].items() if "us" in v}
            if ok:
                best = min(ok, key=lambda c: ok[c]["us"])
                tag, mult = best.split("/")
                variant = prefix + tag
                c = dict(k.consts[variant], target_programs=int(mult[1:]) * sms)
                r["best"] = best
                r["best_us"] = ok[best]["us"]
                r["best_pdl_us"] = graph_time(lambda i: gemm(variant, x, ws[i % copies], c, pdl=True))
                r["table_us"] = min((v["us"] for cc, v in ok.items() if cc.startswith("table/")), default=None)
                r["best_TBps"] = n * kdim * 2 / (r["best_us"] * 1e-6) / 1e12
                r["speedup"] = r["cublas_us"] / r["best_us"]
            print(f"{key}: cuBLAS {r['cublas_us']:.1f} us, best {r.get('best')} {r.get('best_us', float('nan')):.1f}"
                  f" ({time.time() - t0:.0f} s)", flush=True)
        ws = None   # free this shape's weights before the next
        torch.cuda.empty_cache()
    res["best_per_k_class"] = best_per_k_class(res["shapes"])
    res["step_8b_m32"] = step_totals(res["shapes"], 32)
    res["seconds"] = round(time.time() - t0, 1)
    (out_dir / "skinny_gemm.json").write_text(json.dumps(res, indent=1))
    report(res)


def best_per_k_class(shapes: dict) -> dict:
    """(model, K, silu, M) -> the config (tag/target) whose time summed over that K's projections is least,
    as a decode step runs them (each layer projection num_layers times, the lm_head once): one kernel per
    K and class serves them all."""
    groups: dict = {}
    for key, r in shapes.items():
        shape, m = key.rsplit("_m", 1)
        n, kdim, silu = SHAPES[shape]
        model = shape.split(".")[0]
        weight = 1 if shape.endswith("lm_head") else MODELS[model]["num_layers"]
        groups.setdefault(f"{model}.{'silu_' if silu else ''}k{kdim}_m{m}", []).append((weight, r))
    best = {}
    for gkey, rs in groups.items():
        common = set.intersection(*({c for c, v in r["configs"].items() if "us" in v} for _, r in rs))
        if common:
            total = {c: sum(w * r["configs"][c]["us"] for w, r in rs) for c in common}
            c = min(total, key=total.get)
            best[gkey] = {"config": c, "step_us": total[c], "cublas_step_us": sum(w * r["cublas_us"] for w, r in rs)}
    return best


def step_totals(shapes: dict, m: int) -> dict:
    """8B decode step at M rows: 4 layer projections x 32 layers + lm_head, cuBLAS / best / better of the two."""
    layer = ("8b.qkv", "8b.o", "8b.gate_up", "8b.down")
    out = {}
    for col in ("cublas_us", "best_us", "best_pdl_us"):
        per = {p: shapes[f"{p}_m{m}"].get(col, float("nan")) for p in layer + ("8b.lm_head",)}
        out[col] = (sum(per[p] for p in layer) * 32 + per["8b.lm_head"]) / 1e3
    per = {p: min(shapes[f"{p}_m{m}"]["cublas_us"], shapes[f"{p}_m{m}"].get("best_pdl_us", float("inf")))
           for p in layer + ("8b.lm_head",)}
    out["pick_ms"] = (sum(per[p] for p in layer) * 32 + per["8b.lm_head"]) / 1e3
    return {k.replace("_us", "_ms"): v for k, v in out.items()}


def report(res: dict):
    print(f"\n===== skinny GEMM vs cuBLAS on {res['gpu']} (torch {res['torch']}), {res['seconds']} s =====")
    failed = {k: [c for c, v in r["configs"].items() if "error" in v] for k, r in res["shapes"].items()}
    failed = {k: v for k, v in failed.items() if v}
    print("check: " + ("every config ok" if not failed else f"FAILED {failed}"))
    print("best per (model, K, M class): one config for all that K's projections, their time in a decode step "
          "(layers x projections + lm_head):")
    for key, b in res["best_per_k_class"].items():
        print(f"  {key:22} {b['config']:18} {b['step_us']:8.1f} us (cuBLAS {b['cublas_step_us']:8.1f})")
    print("us per call, cold L2 (down: cuBLAS = silu_mul kernel + F.linear); best = fastest config/target, "
          "pdl = it launched with PDL")
    print(f"{'shape':12} {'M':>3} {'cuBLAS':>8} {'best config':18} {'best':>7} {'pdl':>7} {'speedup':>7} {'TB/s':>5}")
    for key, r in res["shapes"].items():
        shape, m = key.rsplit("_m", 1)
        if "best" not in r:
            print(f"{shape:12} {m:>3} {r['cublas_us']:8.1f} no config passed")
            continue
        print(f"{shape:12} {m:>3} {r['cublas_us']:8.1f} {r['best']:18} {r['best_us']:7.1f} {r['best_pdl_us']:7.1f} "
              f"{r['speedup']:7.2f} {r['best_TBps']:5.2f}")
    s = res["step_8b_m32"]
    print(f"8B decode step at M=32, dense projections (4 x 32 layers + lm_head): cuBLAS {s['cublas_ms']:.3f} ms, "
          f"best {s['best_ms']:.3f} ms, best+PDL {s['best_pdl_ms']:.3f} ms, better of the two {s['pick_ms']:.3f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("verb", choices=["prepare", "run"])
    ap.add_argument("folder", type=Path, nargs="?", default=ROOT / ".sg_aot")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/engc_skinny_gemm")))
    args = ap.parse_args()
    prepare(args.folder) if args.verb == "prepare" else run(args.folder, args.out)


if __name__ == "__main__":
    main()
