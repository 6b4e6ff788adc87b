"""Check and time the W4A16 GEMM of decode batches (kernels/int4_gemm) on an H200 against bf16 cuBLAS and the
int4 paths bundles use today at those rows: the CUDA int4 GEMV builds (up to 32 rows, 33-64 in two passes
of the 32-row one) and, past that, dequantize + cuBLAS.

  python bench/int4_gemm_device.py prepare .aot_int4_gemm   # here, CPU only: sm90 cubins for a sweep of tile
                                                            # configs per M class (and the CUDA GEMV builds)
  python bench/int4_gemm_device.py run .aot_int4_gemm       # on the GPU box: cubins through the driver API

First correctness: every config on odd shapes (N not a multiple of the tile, K not of BLOCK_K nor of the
group, group 64) and on each 8B shape at every M, against the float64 reference (the dequantized weight,
rel err < 1e-2, split counters back to zero), again after the graph replays. Then timings: Llama-3-8B
projections (qkv, o, gate_up, down; group 128) at M = 9..256, each a CUDA graph cycling through enough
weight copies to miss L2, each config at 1x, 2x and 4x SMs of target_programs. The table (last) gives per M
the 8B's projections of one decode step (32 layers) for bf16, today's int4 path and the best GEMM config,
and the tune table entry per M class. results.json and log.txt go under $OUT.
"""
from __future__ import annotations

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
MS = (9, 16, 24, 32, 48, 64, 96, 128, 192, 256)
SMS = 132
TARGETS = (1, 2, 4)       # target_programs = this x SMs
LAYERS = 32
# config name -> tune overrides of every M class
SWEEP = {"n64k128w4s4_pairs": dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, PAIRS=True),
         # 128-row M tiles for the classes past 64 rows (classes: only those), W read once per 128 rows
         "m128_n64k128w4s4_pairs": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, PAIRS=True,
                                        classes=("m<=128", "m<=256")),
         "m128_n64k64w4s4_pairs": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, PAIRS=True,
                                       classes=("m<=128", "m<=256")),
         "m128_n64k128w8s3_pairs": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=3, PAIRS=True,
                                        classes=("m<=128", "m<=256")),
         "m128_n128k64w8s3_pairs": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, PAIRS=True,
                                        classes=("m<=128", "m<=256"))}
# A subset for a diagnostic run, from the environment (prepare and run alike): INT4_GEMM_SWEEP (config names),
# INT4_GEMM_SHAPES (of SHAPES, or lm_head: an int4 Llama-3 head, engc quantize --lm-head), INT4_GEMM_MS.
# The per-step sums then cover the shapes chosen.
_env = {k: os.environ.get(f"INT4_GEMM_{k}", "") for k in ("SWEEP", "SHAPES", "MS")}
SWEEP = {k: SWEEP[k] for k in _env["SWEEP"].split(",")} if _env["SWEEP"] else SWEEP
SHAPES = ({k: {**SHAPES, "lm_head": (128256, 4096)}[k] for k in _env["SHAPES"].split(",")} if _env["SHAPES"]
          else SHAPES)
MS = tuple(int(m) for m in _env["MS"].split(",")) if _env["MS"] else MS
# earlier sweeps' configs (bench/results/h200_int4_gemm_pairs.txt): float32 dequant n64k64w4s4 / n64k128w4s4,
# PERM_X (x gathered in the interleaved order: slower, removed), PAIRS at n64k64w4s4 / n128k64w8s4 / n128k128w8s3
# today's int4 paths at these rows: the CUDA GEMV builds (kind, max_m) as the tune table has them
CUDA_BUILDS = {"gemv_wide16": 16, "gemv_wide32": 32}
EDGE = [(11, 200, 1056, 64), (40, 72, 4096 + 32, 128), (100, 257, 2080, 128)]   # (M, N, K, group)


def _llama8b():
    from engc.bundle.model_config import ModelConfig
    return ModelConfig(family="llama", vocab_size=512, hidden_size=4096, intermediate_size=14336, num_layers=1,
                       num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
                       max_position_embeddings=256, tie_word_embeddings=False)


# ------------------------------------------------------------------------------------------ prepare (CPU)

def prepare(out_dir: Path):
    from engc.compiler.codegen import cuda, cuda_int4, tune
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import int4_gemm_specs
    t0, index, sets = time.time(), {}, {}
    for name, ov in SWEEP.items():
        specs, ov = [], dict(ov)
        classes = ov.pop("classes", tune.INT4_GEMM_M_CLASSES)
        for bucket in classes:
            specs += int4_gemm_specs(_llama8b(), "bf16", "sm90", (GROUP,), {bucket: ov}, classes=(bucket,),
                                     enabled_only=False)
        for m, _, k, g in EDGE:   # the odd shapes' K and group, in the class that holds their M
            bucket = next(b for b in tune.INT4_GEMM_M_CLASSES if m <= int(b[3:]))
            if bucket not in classes:
                continue
            specs += int4_gemm_specs(_llama8b(), "bf16", "sm90", (g,), {bucket: ov}, classes=(bucket,),
                                     enabled_only=False, widths=(k,))
        sets[f"gemm/{name}"] = compile_specs(specs, jobs=2)
        print(f"gemm/{name}: {len(specs)} kernels ({time.time() - t0:.0f}s)", flush=True)
    for kind in CUDA_BUILDS:
        if cuda.nvcc_path() is not None:
            sets[f"cuda/{kind}"] = cuda.compile_cuda([cuda_int4.int4_gemv_spec(GROUP, "bf16", "sm90", None, kind)[0]])
    for set_name, res in sets.items():
        for path, data in res.files.items():
            dst = out_dir / set_name / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
        index[set_name] = res.records
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))


# ------------------------------------------------------------------------------------------ run (GPU)

def run(aot: Path, out: Path):
    import torch
    import torch.nn.functional as F
    from int4_cuda_device import make_weights
    from kernels_device import RunLog, load_sets, rel_err, time_graph
    from engc.kernels import gemv, int4_gemm
    from engc.kernels import int4_linear as op
    run_log = RunLog()
    say = run_log.say
    sets = load_sets(aot)
    counters = torch.zeros(gemv.NUM_COUNTERS, dtype=torch.int32, device="cuda")
    packed = op.PackedScales()   # the packed_sz builds' scale / zero words, once a weight
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": [], "timings": []}

    def gemm(name, target, x, w, group):
        ks = sets[name]
        consts = {v: dict(c, target_programs=target) for v, c in ks.consts("int4_gemm").items()}
        variant = int4_gemm.pick(consts, x.shape[1], group, x.shape[0])
        if variant is None:   # a config swept on some M classes only
            return None
        y = torch.empty(x.shape[0], w[0].shape[0], dtype=x.dtype, device="cuda")
        ks.run("int4_gemm", int4_gemm.launch(x, *w, y, variant, consts[variant], counters))
        return y

    def cuda_gemv(x, w, group):   # today's path: the narrowest CUDA build that holds M, or two passes
        consts = {}
        for kind in CUDA_BUILDS:
            consts.update(sets[f"cuda/{kind}"].consts("int4_linear"))
        y = torch.empty(x.shape[0], w[0].shape[0], dtype=x.dtype, device="cuda")
        for a, b in op.cuda_row_slices(x.shape[0], group, consts):
            v = op.cuda_variant_for(b - a, group, consts)
            sets[next(f"cuda/{k}" for k in CUDA_BUILDS if v in sets[f"cuda/{k}"].consts("int4_linear"))].run(
                "int4_linear", op.cuda_launch(x[a:b], *w, None, y[a:b], group_size=group, consts=consts,
                                              counters=counters, packed=packed))
        return y

    def check(tag, got, ref):
        err = rel_err(got, ref)
        ok = err < 1e-2 and int(counters.abs().sum().item()) == 0
        results["checks"].append(dict(tag, err=err, ok=ok))
        if not ok:
            say(f"CHECK FAILED {tag}: rel err {err:.2e}, counters {int(counters.abs().sum().item())}")
        return ok

    gen = torch.Generator(device="cuda").manual_seed(0)
    gemm_sets = [n for n in sets if n.startswith("gemm/")]
    for m, n, k, group in EDGE:
        w = make_weights(n, k, group, 1, gen)[0]
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
        ref = x.double() @ op.dequantize(*w, group).double().t()
        for name in gemm_sets:
            for target in (SMS, 4 * SMS):
                if gemm(name, target, x, w, group) is None:
                    continue
                check(dict(case="edge", M=m, N=n, K=k, group=group, set=name, target=target),
                      gemm(name, target, x, w, group), ref)
    say(f"edge checks: {sum(c['ok'] for c in results['checks'])}/{len(results['checks'])} ok "
        f"({run_log.elapsed():.0f}s)")
    for shape, (n, k) in SHAPES.items():
        wbytes = n * k // 2 + 3 * n * (k // GROUP)
        copies = max(2, math.ceil(150e6 / wbytes))
        ws = make_weights(n, k, GROUP, copies, gen)
        dense = [op.dequantize(*ws[i], GROUP) for i in range(max(2, math.ceil(150e6 / (2 * n * k))))]
        ref_w = dense[0].double()
        for m in MS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
            ref = x.double() @ ref_w.t()
            row = dict(shape=shape, N=n, K=k, M=m, wbytes=wbytes)
            us = time_graph(lambda i: F.linear(x, dense[i % len(dense)]), len(dense))
            results["timings"].append(dict(row, set="bf16", us=us, tbs=2 * n * k / us / 1e6))
            if m <= 64 and check(dict(row, set="cuda_gemv"), cuda_gemv(x, ws[0], GROUP), ref):
                us = time_graph(lambda i: cuda_gemv(x, ws[i], GROUP), copies)
                results["timings"].append(dict(row, set="cuda_gemv", us=us, tbs=wbytes / us / 1e6))
            for name in gemm_sets:
                for mult in TARGETS:
                    tag = dict(row, set=name, target=mult * SMS)
                    if gemm(name, mult * SMS, x, ws[0], GROUP) is None:
                        continue
                    if not check(tag, gemm(name, mult * SMS, x, ws[0], GROUP), ref):
                        continue
                    us = time_graph(lambda i: gemm(name, mult * SMS, x, ws[i], GROUP), copies)
                    if check(dict(tag, after="graph"), gemm(name, mult * SMS, x, ws[0], GROUP), ref):
                        results["timings"].append(dict(tag, us=us, tbs=wbytes / us / 1e6))
        say(f"{shape}: done ({run_log.elapsed():.0f}s)")
        ws = dense = None
        torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table(results, say)
    run_log.finish(out)


# today's int4 path past 64 rows: the CUDA dequant (bench/results/h200_59ba135_int4_variants.txt, w8c2, us per
# projection) + the bf16 GEMM
DEQUANT_US = {"qkv": 38.0, "o": 26.7, "gate_up": 163.2, "down": 83.9}


def table(results, say):
    from engc.compiler.codegen import tune
    bad = [c for c in results["checks"] if not c["ok"]]
    ts = results["timings"]
    say("")
    say(f"== checks: {len(results['checks']) - len(bad)}/{len(results['checks'])} ok (rel err < 1e-2 vs float64, "
        "before and after graph replay, counters back to zero) ==")
    for c in bad[:10]:
        say(f"  FAILED {c}")
    say("== us per projection at each M: bf16 cuBLAS | today's int4 (CUDA GEMV; past 64 rows dequant + cuBLAS) | "
        "best int4 GEMM (config, target) ==")
    step = {}
    for m in MS:
        for shape in SHAPES:
            mine = [t for t in ts if t["shape"] == shape and t["M"] == m]
            bf = next(t["us"] for t in mine if t["set"] == "bf16")
            today = next((t["us"] for t in mine if t["set"] == "cuda_gemv"), bf + DEQUANT_US.get(shape, math.nan))
            best = min((t for t in mine if t["set"].startswith("gemm/")), key=lambda t: t["us"], default=None)
            say(f"  M={m:<3} {shape:<8} bf16 {bf:7.2f}  int4 today {today:7.2f}  "
                + (f"gemm {best['us']:7.2f} ({best['set'][5:]} t{best['target']}) {bf / best['us']:.2f}x bf16"
                   if best else "gemm -"))
            s = step.setdefault(m, {"bf16": 0.0, "today": 0.0})
            s["bf16"] += LAYERS * bf / 1e3
            s["today"] += LAYERS * today / 1e3
    say("== the 8B's projections per decode step (32 layers), ms: bf16 | int4 today | int4 GEMM, one config per "
        "M class (the best over the class's Ms) ==")
    for bucket in tune.INT4_GEMM_M_CLASSES:
        entry = tune.TUNE[f"sm90/int4_gemm/*/{bucket}"]
        lo, hi = entry["min_m"], entry["max_m"]
        ms = [m for m in MS if lo <= m <= hi]
        per = {}
        for t in ts:
            if t["set"].startswith("gemm/") and t["M"] in ms:
                per.setdefault((t["set"], t["target"]), []).append(t["us"])
        full = {key: sum(v) for key, v in per.items() if len(v) == len(ms) * len(SHAPES)}
        if not full:
            say(f"  {bucket}: no config passed every case")
            continue
        (name, target), total = min(full.items(), key=lambda kv: kv[1])
        for m in ms:
            g = sum(t["us"] for t in ts if t["set"] == name and t["target"] == target and t["M"] == m)
            say(f"  M={m:<3} bf16 {step[m]['bf16']:.3f}  int4 today {step[m]['today']:.3f}  gemm {LAYERS * g / 1e3:.3f}"
                f"  ({name[5:]} t{target})")
        say(f"  for the tune table (sm90/int4_gemm/*/{bucket}): {SWEEP[name[5:]]}, target_programs={target // SMS} * SMs")


if __name__ == "__main__":
    from kernels_device import step_main
    step_main({"prepare": lambda aot, out: prepare(aot), "run": run})
