"""Check and time engc's decode GEMV (kernels/gemv) against cuBLAS (F.linear) on an H200.

Two steps, two machines (like bench/kernels_device.py):
  python bench/gemv_device.py prepare .aot_gemv   # here, CPU only: compile sm90 cubins for a config sweep
  python bench/gemv_device.py run .aot_gemv       # on the GPU box: load them through engc._native (the
                                                  # runtime's launcher), check vs torch, time, print table
  python bench/gemv_device.py prepare-pick .aot_gemv_pick  # here: the GEMV kernels an 8B and a 1B bundle get
  python bench/gemv_device.py run-pick .aot_gemv_pick      # there (~15 s): at M=1, the runtime's pick
                                                  # (kernels/gemv.pick by K, N, M; None = cuBLAS) vs cuBLAS
                                                  # per projection, and per decode step (layers x 4 + lm_head)
Shapes: the Llama-3-8B and Llama-3.2-1B projections (qkv, o, gate_up, SiLU-fused down, lm_head) at
M = 1, 2, 4, 8, 16 (the pick run: M = 1). Each config is timed inside one CUDA graph that cycles through enough weight copies
to miss L2 (like a real step), so a figure is per launch, launch gaps included; TB/s counts the weight
bytes. For the SiLU-fused down, the cuBLAS figure is F.linear on the ready activation (the fallback
also runs the silu_mul kernel, 1-1.4 us). The table at the end says, per shape and M, cuBLAS, the default config and the best config, and
per (K, M class) which config and target_programs to put in the tune table. results.json goes under $OUT.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMS = 132
SHAPES = {  # name -> (N, K, silu)
    "8b.qkv": (6144, 4096, False), "8b.o": (4096, 4096, False), "8b.gate_up": (28672, 4096, False),
    "8b.down": (4096, 14336, True), "8b.lm_head": (128256, 4096, False),
    "1b.qkv": (3072, 2048, False), "1b.o": (2048, 2048, False), "1b.gate_up": (16384, 2048, False),
    "1b.down": (2048, 8192, True), "1b.lm_head": (128256, 2048, False),
}
MS = (1, 2, 4, 8, 16)
# per M class: config name -> tune overrides ("default" is the tune table's entry)
SWEEP = {
    "m<=4": {"default": {}, "n16k1024w4": dict(BLOCK_N=16, BLOCK_K=1024, num_warps=4),
             "n4k1024w4": dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4),
             "n8k2048w8": dict(BLOCK_N=8, BLOCK_K=2048, num_warps=8),
             "n8k512w2": dict(BLOCK_N=8, BLOCK_K=512, num_warps=2)},
    "m<=16": {"default": {}, "n16k256w4s4": dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4),
              "n64k128w4s4": dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
              "n32k512w4s3": dict(BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=3),
              "n32k256w8s5": dict(BLOCK_N=32, BLOCK_K=256, num_warps=8, num_stages=5)},
}
TARGETS = (2, 4, 8)  # target_programs = this x SMs (a launch constant: no recompile)


# the models whose projections SHAPES lists, as the build sees them (run-pick's per-step sums use num_layers)
MODELS = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
               num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
               num_kv_heads=8, head_dim=64, tie_word_embeddings=True),
}


def _model_cfg(name: str):
    from engc.bundle.model_config import ModelConfig
    return ModelConfig(family="llama", rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=131072,
                       **MODELS[name])


def _cfg(k: int):
    from engc.bundle.model_config import ModelConfig
    return ModelConfig(family="llama", vocab_size=128256, hidden_size=k, intermediate_size=k, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=k, rms_norm_eps=1e-5, rope_theta=5e5,
                       max_position_embeddings=8192, tie_word_embeddings=True)


# ------------------------------------------------------------------------------------------ prepare (CPU)

def prepare(out_dir: Path):
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.decode_gemm_specs import gemv_specs
    pairs = sorted({(k, silu) for _, k, silu in SHAPES.values()})
    index = {}
    t0 = time.time()
    for m_class, configs in SWEEP.items():
        for name, ov in configs.items():
            specs = []
            for k, silu in pairs:
                specs += [s for s in gemv_specs(_cfg(k), "bf16", "sm90", {m_class: ov} if ov else None,
                                            classes=tuple(SWEEP))
                          if s.tune_key.split("/")[3].startswith(m_class) and s.constexprs["SILU"] == silu
                          and s.constexprs["K"] == k]
            res = compile_specs(specs, progress=None)
            for path, data in res.files.items():
                dst = out_dir / m_class.replace("<=", "le") / name / path
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(data)
            index.setdefault(m_class, {})[name] = res.records
            print(f"{m_class}/{name}: {len(specs)} kernels ({time.time() - t0:.0f}s)", flush=True)
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))


def prepare_pick(out_dir: Path):
    """The GEMV kernels a bf16 sm90 bundle of each model holds (decode_gemm_specs.gemv_specs with the tune table as it
    is), compiled as the build does."""
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.decode_gemm_specs import gemv_specs
    index = {}
    for model in MODELS:
        specs = gemv_specs(_model_cfg(model), "bf16", "sm90")
        res = compile_specs(specs, progress=None)
        for path, data in res.files.items():
            dst = out_dir / model / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
        index[model] = res.records
        print(f"{model}: {', '.join(s.variant for s in specs)}", flush=True)
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))


# ------------------------------------------------------------------------------------------ run (GPU)

class Kernels:
    """One sweep config's cubins, loaded through engc.cuda.cubin like BundleKernels does."""

    def __init__(self, base: Path, records: list[dict]):
        from engc.cuda.cubin import load_kernel, signature_from_triton
        self.kernels, self.consts = {}, {}
        for r in records:
            sig = signature_from_triton([a["type"] for a in r["args"][:-2]])
            self.kernels[r["variant"]] = load_kernel((base / r["cubin"]).read_bytes(), r["entry"], sig,
                                                     block_x=32 * r["num_warps"], shared_mem=r["shared_mem"],
                                                     scratch_params=2)
            self.consts[r["variant"]] = r["launch"]

    def pick(self, x, w, silu):
        """The variant the runtime would launch (gpu_ops.run_gemv), or None: cuBLAS."""
        from engc.kernels import gemv
        return gemv.pick(gemv.variant_table(self.consts), w.shape[1], silu, x.shape[0], w.shape[0])

    def launches(self, x, w, out, silu, counters, target=None):
        """target: target_programs in place of the record's (the sweep)."""
        import torch
        from engc.kernels import gemv
        variant = self.pick(x, w, silu)
        consts = dict(self.consts[variant], **({"target_programs": target} if target else {}))
        return [(self.kernels[v], grid, [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args[:-2]],
                 args) for v, grid, args in gemv.launch(x, w, out, variant, consts, counters)]


def time_graph(fn, copies, reps=10):
    """Median us per call of fn(i), i cycling over copies, inside one captured CUDA graph."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / copies)
    return sorted(times)[len(times) // 2]


def run(aot: Path, out: Path):
    import torch
    import torch.nn.functional as F
    from engc.kernels import gemv
    from engc.kernels.silu_mul import silu_mul
    from engc.cuda.cubin import current_stream
    from kernels_device import RunLog
    run_log = RunLog()
    say = run_log.say
    index = json.loads((aot / "index.json").read_text())
    sets = {(mc, name): Kernels(aot / mc.replace("<=", "le") / name, recs)
            for mc, configs in index.items() for name, recs in configs.items()}
    counters = torch.zeros(gemv.NUM_COUNTERS, dtype=torch.int32, device="cuda")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": [], "timings": []}

    bf = torch.bfloat16
    for shape, (n, k, silu) in SHAPES.items():
        w_bytes = n * k * 2
        copies = max(1, min(48, math.ceil(400e6 / w_bytes)))
        ws = [torch.randn(n, k, dtype=bf, device="cuda") / k ** 0.5 for _ in range(copies)]
        for m in MS:
            m_class = "m<=4" if m <= 4 else "m<=16"
            x = torch.randn(m, 2 * k if silu else k, dtype=bf, device="cuda")
            outs = [torch.empty(m, n, dtype=bf, device="cuda") for _ in range(copies)]
            ref = (gemv.silu_mul_linear(x, ws[0]) if silu else F.linear(x, ws[0])).float()
            # cuBLAS alone on the activation; the runtime's fallback for down adds engc's silu_mul kernel
            # (1-1.4 us on the H200 profile) that the fused GEMV saves
            act = silu_mul(x) if silu else x
            us_cublas = time_graph(lambda i: F.linear(act, ws[i]), copies)
            row = dict(shape=shape, N=n, K=k, M=m, cublas_us=us_cublas, cublas_tbs=w_bytes / us_cublas / 1e6)
            for (mc, name), ks in sets.items():
                if mc != m_class:
                    continue
                for mult in TARGETS:
                    plans = [ks.launches(x, ws[i], outs[i], silu, counters, mult * SMS) for i in range(copies)]
                    for kern, grid, ptrs, _ in plans[0]:
                        kern.launch(grid, ptrs, current_stream())
                    err = float((outs[0].float() - ref).norm() / ref.norm())
                    ok = err < 1e-2 and int(counters.abs().sum().item()) == 0
                    results["checks"].append(dict(shape=shape, M=m, config=name, target=mult * SMS, err=err, ok=ok))
                    if not ok:
                        say(f"CHECK FAILED {shape} M={m} {mc}/{name} t={mult * SMS}: rel err {err:.2e}")
                        continue

                    def launch_all(i):
                        for kern, grid, ptrs, _ in plans[i]:
                            kern.launch(grid, ptrs, current_stream())
                    us = time_graph(launch_all, copies)
                    splits = plans[0][0][1][1]
                    results["timings"].append(dict(row, config=name, target=mult * SMS, splits=splits, us=us,
                                                   tbs=w_bytes / us / 1e6, vs_cublas=us_cublas / us))
            best = min((t for t in results["timings"] if t["shape"] == shape and t["M"] == m),
                       key=lambda t: t["us"], default=None)
            if best:
                say(f"{shape:<12} M={m:<2} cuBLAS {us_cublas:7.2f} us | best {best['config']}/t{best['target']} "
                    f"s{best['splits']} {best['us']:7.2f} us {best['tbs']:.2f} TB/s ({best['vs_cublas']:.2f}x)")
            del outs
        ws = None  # free this shape's copies before the next one's
        torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table(results, say)
    run_log.finish(out)


def run_pick(aot: Path, out: Path):
    """M=1, per projection: what the runtime launches (the bundle's kernel kernels/gemv.pick chooses, else
    cuBLAS) against cuBLAS alone, checked against torch first; then per decode step of each model."""
    import torch
    import torch.nn.functional as F
    from engc.kernels import gemv
    from engc.kernels.silu_mul import silu_mul
    from engc.cuda.cubin import current_stream
    started = time.time()
    index = json.loads((aot / "index.json").read_text())
    sets = {model: Kernels(aot / model, recs) for model, recs in index.items()}
    counters = torch.zeros(gemv.NUM_COUNTERS, dtype=torch.int32, device="cuda")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    bf = torch.bfloat16
    for shape, (n, k, silu) in SHAPES.items():
        ks = sets[shape.split(".")[0]]
        w_bytes = n * k * 2
        copies = max(1, min(48, math.ceil(400e6 / w_bytes)))
        ws = [torch.randn(n, k, dtype=bf, device="cuda") / k ** 0.5 for _ in range(copies)]
        x = torch.randn(1, 2 * k if silu else k, dtype=bf, device="cuda")
        outs = [torch.empty(1, n, dtype=bf, device="cuda") for _ in range(copies)]
        act = silu_mul(x) if silu else x
        us_cublas = time_graph(lambda i: F.linear(act, ws[i]), copies)
        variant = ks.pick(x, ws[0], silu)
        row = dict(shape=shape, N=n, K=k, variant=variant or "cuBLAS", cublas_us=us_cublas, engc_us=us_cublas,
                   ok=True, err=0.0)
        if variant is not None:
            ref = (gemv.silu_mul_linear(x, ws[0]) if silu else F.linear(x, ws[0])).float()
            plans = [ks.launches(x, ws[i], outs[i], silu, counters) for i in range(copies)]
            for kern, grid, ptrs, _ in plans[0]:
                kern.launch(grid, ptrs, current_stream())
            err = float((outs[0].float() - ref).norm() / ref.norm())
            row.update(err=err, ok=err < 1e-2 and int(counters.abs().sum().item()) == 0,
                       splits=plans[0][0][1][1])

            def launch_all(i):
                for kern, grid, ptrs, _ in plans[i]:
                    kern.launch(grid, ptrs, current_stream())
            row["engc_us"] = time_graph(launch_all, copies) if row["ok"] else float("nan")
        results["rows"].append(row)
        print(f"{shape:<12} {row['variant']:<20} cuBLAS {us_cublas:7.2f} us  engc {row['engc_us']:7.2f} us"
              f"{'' if row['ok'] else '  CHECK FAILED rel err %.2e' % row['err']}", flush=True)
        del ws, outs
        torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    (out / "pick_results.json").write_text(json.dumps(results, indent=1))
    rows = {r["shape"]: r for r in results["rows"]}
    bad = [r["shape"] for r in results["rows"] if not r["ok"]]
    print(f"\n== checks: {len(rows) - len(bad)}/{len(rows)} ok (rel err < 1e-2 vs torch, counters zero) "
          f"{'FAILED: ' + ', '.join(bad) if bad else ''}==")
    print("== M=1, us per launch, cold L2 (before = cuBLAS, except down: the SiLU-fused GEMV it already had) ==")
    print(f"  {'shape':<12} {'runtime picks':<20} {'cuBLAS':>8} {'engc':>8} {'gain':>6}")
    for r in results["rows"]:
        print(f"  {r['shape']:<12} {r['variant']:<20} {r['cublas_us']:8.2f} {r['engc_us']:8.2f} "
              f"{r['cublas_us'] / r['engc_us']:5.2f}x")
    for model in MODELS:
        layers = MODELS[model]["num_layers"]
        per = {p: rows[f"{model}.{p}"] for p in ("qkv", "o", "gate_up", "down", "lm_head")}

        def step(pick_plain):
            layer = sum(r["engc_us"] if pick_plain or r["shape"].endswith(".down") else r["cublas_us"]
                        for p, r in per.items() if p != "lm_head")
            head = per["lm_head"]["engc_us"] if pick_plain else per["lm_head"]["cublas_us"]
            return layers * layer + head
        print(f"  {model} per decode step ({layers} layers x qkv+o+gate_up+down, + lm_head): before "
              f"{step(False):.1f} us, now {step(True):.1f} us ({step(False) - step(True):+.1f} us saved)")
    print(f"total {time.time() - started:.0f}s")


def table(results, say):
    bad = [c for c in results["checks"] if not c["ok"]]
    say("")
    say(f"== checks: {len(results['checks']) - len(bad)}/{len(results['checks'])} ok (rel err < 1e-2 vs torch, "
        "split counters back to zero) ==")
    say("== per shape: us per launch (TB/s of weight); default = tune table entry at target 4x SMs ==")
    say(f"  {'shape':<12} {'M':>2} {'cuBLAS':>15} {'default':>15} {'best':>15}  best config")
    for shape in SHAPES:
        for m in MS:
            ts = [t for t in results["timings"] if t["shape"] == shape and t["M"] == m]
            if not ts:
                continue
            best = min(ts, key=lambda t: t["us"])
            de = next((t for t in ts if t["config"] == "default" and t["target"] == 4 * SMS), best)
            say(f"  {shape:<12} {m:>2} {ts[0]['cublas_us']:7.2f} ({ts[0]['cublas_tbs']:4.2f}) "
                f"{de['us']:7.2f} ({de['tbs']:4.2f}) {best['us']:7.2f} ({best['tbs']:4.2f})  "
                f"{best['config']} t={best['target']} splits={best['splits']} ({best['vs_cublas']:.2f}x cuBLAS)")
    say("== for the tune table: per M class, the config with the least total us over all shapes and M of the class ==")
    for m_class, ms in (("m<=4", (1, 2, 4)), ("m<=16", (8, 16))):
        totals = {}
        for t in results["timings"]:
            if t["M"] in ms:
                key = (t["config"], t["target"])
                totals[key] = totals.get(key, 0.0) + t["us"]
        cublas = sum({(t["shape"], t["M"]): t["cublas_us"] for t in results["timings"] if t["M"] in ms}.values())
        if totals:
            (cfg, tgt), us = min(totals.items(), key=lambda kv: kv[1])
            ov = SWEEP[m_class][cfg]
            say(f"  {m_class}: {cfg} {ov or '(tune default)'} target_programs={tgt}: {us:.1f} us total "
                f"vs cuBLAS {cublas:.1f} us")


if __name__ == "__main__":
    from kernels_device import step_main
    step_main({"prepare": lambda aot, out: prepare(aot), "run": run,
               "prepare-pick": lambda aot, out: prepare_pick(aot), "run-pick": run_pick})
