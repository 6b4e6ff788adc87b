"""Check and time the CUDA C++ decode GEMV (templates/gemv.cu.j2) against cuBLAS and the Triton GEMV on an H200.

Two steps, two machines (like bench/gemv_device.py):
  python bench/gemv_cuda_device.py prepare .aot_gemv_cuda   # here, CPU only: nvcc sm90 cubins for a sweep of
                                                            # template constants, plus the Triton GEMV as tuned
  python bench/gemv_cuda_device.py run .aot_gemv_cuda       # on the GPU box: load them through engc's cubin
                                                            # launcher, check vs torch, time, print the table
Shapes: the Llama-3-8B and Llama-3.2-1B projections (qkv, o, gate_up, SiLU-fused down, lm_head), M = 1, 2,
4, 8. Every timing is one CUDA graph cycling through enough weight copies to miss L2 (a real decode step's
situation), so a figure is per launch with launch gaps; TB/s counts the weight bytes. For down, cuBLAS is
F.linear on the ready activation (the runtime's fallback also runs silu_mul, ~1-1.4 us). Each CUDA config
runs at 2x, 4x and 8x SMs of target_programs (a launch constant: no recompile); every launch is checked
against torch (rel err < 1e-2, split counters back to zero) before it is timed and again after the graph
replays. results.json and log.txt go under $OUT; the table is printed last, with the tune table entry to use.
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
from gemv_device import SHAPES, time_graph  # noqa: E402  (shapes of the Triton GEMV sweep, graph timing)

SMS = 132
MS = (1, 2, 4, 8)
TARGETS = (2, 4, 8)                     # target_programs = this x SMs
CUDA_CLASS = "m<=8"
# config name -> template constants (w warps, t 16-row tiles per warp, u 32-wide K steps, b CTAs per SM)
SWEEP = {"w4t2u4b4": dict(num_warps=4, TILES=2, UNROLL=4, min_blocks=4),
         "w4t1u8b3": dict(num_warps=4, TILES=1, UNROLL=8, min_blocks=3),
         "w4t4u2b4": dict(num_warps=4, TILES=4, UNROLL=2, min_blocks=4),
         "w4t2u2b6": dict(num_warps=4, TILES=2, UNROLL=2, min_blocks=6),
         "w8t2u4b2": dict(num_warps=8, TILES=2, UNROLL=4, min_blocks=2),
         "w2t2u8b4": dict(num_warps=2, TILES=2, UNROLL=8, min_blocks=4)}
TRITON_CLASSES = {1: "m<=1", 2: "m<=4", 4: "m<=4", 8: "m<=16"}   # the tune table's Triton GEMV per M
TARGET_SHAPES = ("qkv", "o", "down")    # the brief: >= 1.15x cuBLAS there at M 1..4


def _pairs():
    return sorted({(k, silu) for _, k, silu in SHAPES.values()})


def _cfg(k: int):
    from engc.bundle.model_config import ModelConfig
    return ModelConfig(family="llama", vocab_size=128256, hidden_size=k, intermediate_size=k, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=k, rms_norm_eps=1e-5, rope_theta=5e5,
                       max_position_embeddings=8192, tie_word_embeddings=True)


# ------------------------------------------------------------------------------------------ prepare (CPU)

def prepare(out_dir: Path):
    from engc.compiler.codegen import cuda, cuda_gemv
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.decode_gemm_specs import gemv_specs
    if cuda.nvcc_path() is None:
        raise SystemExit("nvcc not found: the CUDA GEMV cannot be built here")
    t0, index = time.time(), {}
    sets = {}
    for name, ov in SWEEP.items():
        specs = [cuda_gemv.gemv_spec(k, silu, "bf16", "sm90", CUDA_CLASS, ov)[0] for k, silu in _pairs()]
        sets[f"cuda/{name}"] = cuda.compile_cuda(specs)
        print(f"cuda/{name}: {len(specs)} kernels ({time.time() - t0:.0f}s)", flush=True)
    classes = tuple(sorted(set(TRITON_CLASSES.values())))
    plain_on = {c: {"plain": True} for c in classes}
    specs = [s for k, silu in _pairs() for s in gemv_specs(_cfg(k), "bf16", "sm90", plain_on, classes=classes)
             if s.constexprs["K"] == k and s.constexprs["SILU"] == silu]
    sets["triton"] = compile_specs(specs, jobs=1)
    print(f"triton: {len(specs)} kernels ({time.time() - t0:.0f}s)", flush=True)
    for set_name, res in sets.items():
        for path, data in res.files.items():
            dst = out_dir / set_name / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
        index[set_name] = res.records
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))


# ------------------------------------------------------------------------------------------ run (GPU)

class KernelSet:
    """One set's cubins, loaded through engc.cuda.cubin as BundleKernels does (CUDA: no scratch)."""

    def __init__(self, base: Path, records: list[dict]):
        from engc.kernels import gemv
        from engc.cuda.cubin import load_kernel, signature_from_triton
        self.kernels, self.consts = {}, {}
        for r in records:
            scratch = r.get("scratch_params", 2)
            sig = signature_from_triton([a["type"] for a in r["args"][:len(r["args"]) - scratch]])
            self.kernels[r["variant"]] = load_kernel((base / r["cubin"]).read_bytes(), r["entry"], sig,
                                                     block_x=32 * r["num_warps"], shared_mem=r["shared_mem"],
                                                     scratch_params=scratch)
            self.consts[r["variant"]] = r["launch"]
        self.table = gemv.variant_table(self.consts)

    def plan(self, x, w, out, silu, counters, target=None):
        """[(kernel, grid, pointer args)] for one call; None when the set has no kernel for it."""
        import torch
        from engc.kernels import gemv
        variant = gemv.pick(self.table, w.shape[1], silu, x.shape[0], w.shape[0])
        if variant is None:
            return None
        consts = dict(self.consts[variant], **({"target_programs": target} if target else {}))
        plans = []
        for v, grid, args in gemv.launch(x, w, out, variant, consts, counters):
            kernel = self.kernels[v]
            plans.append((kernel, grid, [a.data_ptr() if isinstance(a, torch.Tensor) else a
                                         for a in args[:len(kernel.signature)]], args))
        return plans


def run(aot: Path, out: Path):
    import torch
    import torch.nn.functional as F
    from engc.kernels import gemv
    from engc.kernels.silu_mul import silu_mul
    from engc.cuda.cubin import current_stream
    from kernels_device import RunLog, load_sets
    run_log = RunLog()
    say = run_log.say
    sets = load_sets(aot, KernelSet)
    counters = torch.zeros(gemv.NUM_COUNTERS, dtype=torch.int32, device="cuda")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": [], "timings": []}

    def launch_plan(plan):
        for kern, grid, ptrs, _ in plan:
            kern.launch(grid, ptrs, current_stream())

    def check(tag, got, ref):
        err = float((got.float() - ref).norm() / ref.norm())
        ok = err < 1e-2 and int(counters.abs().sum().item()) == 0
        results["checks"].append(dict(tag, err=err, ok=ok))
        if not ok:
            say(f"CHECK FAILED {tag}: rel err {err:.2e}, counters {int(counters.abs().sum().item())}")
        return ok

    bf = torch.bfloat16
    torch.manual_seed(0)
    for shape, (n, k, silu) in SHAPES.items():
        w_bytes = n * k * 2
        copies = max(1, min(48, math.ceil(400e6 / w_bytes)))
        ws = [torch.randn(n, k, dtype=bf, device="cuda") / k ** 0.5 for _ in range(copies)]
        for m in MS:
            x = torch.randn(m, 2 * k if silu else k, dtype=bf, device="cuda")
            outs = [torch.empty(m, n, dtype=bf, device="cuda") for _ in range(copies)]
            ref = (gemv.silu_mul_linear(x, ws[0]) if silu else F.linear(x, ws[0])).float()
            act = silu_mul(x) if silu else x
            us_cublas = time_graph(lambda i: F.linear(act, ws[i]), copies)
            row = dict(shape=shape, N=n, K=k, M=m, cublas_us=us_cublas)
            runs = [("triton", None)] + [(name, mult * SMS) for name in sets if name != "triton" for mult in TARGETS]
            for set_name, target in runs:
                plans = [sets[set_name].plan(x, ws[i], outs[i], silu, counters, target) for i in range(copies)]
                if plans[0] is None:
                    continue
                tag = dict(shape=shape, M=m, set=set_name, target=target)
                launch_plan(plans[0])
                if not check(tag, outs[0], ref):
                    continue
                us = time_graph(lambda i: launch_plan(plans[i]), copies)
                if not check(dict(tag, after="graph"), outs[0], ref):
                    continue
                results["timings"].append(dict(row, set=set_name, target=target, splits=plans[0][0][1][1], us=us,
                                               tbs=w_bytes / us / 1e6))
            mine = [t for t in results["timings"] if t["shape"] == shape and t["M"] == m]
            best = min((t for t in mine if t["set"] != "triton"), key=lambda t: t["us"], default=None)
            tri = next((t for t in mine if t["set"] == "triton"), None)
            if best:
                say(f"{shape:<12} M={m} cuBLAS {us_cublas:7.2f} | triton {tri['us'] if tri else float('nan'):7.2f} | "
                    f"best {best['set']}/t{best['target']} s{best['splits']} {best['us']:7.2f} us "
                    f"{best['tbs']:.2f} TB/s ({us_cublas / best['us']:.2f}x cuBLAS)")
        ws = outs = None   # free this shape's copies before the next one's
        torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table(results, say)
    run_log.finish(out)


def _kind(shape: str) -> str:
    return shape.split(".")[1]


def table(results, say):
    bad = [c for c in results["checks"] if not c["ok"]]
    ts = results["timings"]
    say("")
    say(f"== checks: {len(results['checks']) - len(bad)}/{len(results['checks'])} ok (rel err < 1e-2 vs torch "
        "before and after graph replay, split counters back to zero) ==")
    # the one CUDA config and target the tune table gets: least total us over the target shapes, M 1..8
    totals = {}
    for t in ts:
        if t["set"] != "triton" and _kind(t["shape"]) in TARGET_SHAPES:
            totals[(t["set"], t["target"])] = totals.get((t["set"], t["target"]), 0.0) + t["us"]
    if not totals:
        say("no CUDA timings")
        return
    (chosen, target), _ = min(totals.items(), key=lambda kv: kv[1])
    say(f"== us per launch (TB/s of weight); CUDA = {chosen} at target_programs {target}; "
        "x = cuBLAS / CUDA ==")
    say(f"  {'shape':<12} {'M':>1} {'cuBLAS':>14} {'triton':>14} {'CUDA':>14} {'x':>5}  {'best CUDA (any config)':<26}")
    wins = {}
    for shape in SHAPES:
        for m in MS:
            mine = [t for t in ts if t["shape"] == shape and t["M"] == m]
            c = next((t for t in mine if (t["set"], t["target"]) == (chosen, target)), None)
            if c is None:
                continue
            tri = next((t for t in mine if t["set"] == "triton"), None)
            best = min((t for t in mine if t["set"] != "triton"), key=lambda t: t["us"])
            w_tbs = c["tbs"] * c["us"]
            tri_s = f"{tri['us']:7.2f} ({tri['tbs']:4.2f})" if tri else f"{'-':>14}"
            say(f"  {shape:<12} {m:>1} {c['cublas_us']:7.2f} ({w_tbs / c['cublas_us']:4.2f}) {tri_s} "
                f"{c['us']:7.2f} ({c['tbs']:4.2f}) {c['cublas_us'] / c['us']:5.2f}  "
                f"{best['set'].split('/')[-1]} t{best['target']} {best['us']:.2f}")
            rival = min(c["cublas_us"], tri["us"] if tri else math.inf)
            wins.setdefault(("silu" if _kind(shape) == "down" else "plain", m), []).append(
                (shape, c["N"], rival / c["us"]))
    say("== for the tune table (sm90/gemv/cuda/m<=8): CUDA wins where it beats both cuBLAS and Triton ==")
    for kind in ("plain", "silu"):
        won = [m for m in MS if all(r > 1.0 for s, _, r in wins.get((kind, m), []) if _kind(s) in TARGET_SHAPES)]
        max_m = next((m for m in reversed(MS) if all(x in won for x in MS if x <= m)), 0)
        losers = sorted({n for m in MS if m <= max_m for s, n, r in wins.get((kind, m), []) if r <= 1.0})
        small = [n for m in MS if m <= max_m for s, n, r in wins.get((kind, m), []) if r > 1.0]
        max_n = 0 if not losers else max([n for n in small if n < min(losers)], default=0)
        say(f"  {kind}: wins on {'qkv, o' if kind == 'plain' else 'down'} for M <= {max_m} (0: nowhere)"
            + (f"; loses at N >= {min(losers)} -> max_n={max_n}" if losers else ""))
    cfg = SWEEP[chosen.split("/")[-1]]
    say(f"  entry: {', '.join(f'{k}={v}' for k, v in cfg.items())}, target_programs={target} "
        f"({target // SMS} * SM_COUNT[_arch])")


if __name__ == "__main__":
    from kernels_device import step_main
    step_main({"prepare": lambda aot, out: prepare(aot), "run": run})
