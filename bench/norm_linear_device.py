#!/usr/bin/env python3
"""Residual add + RMSNorm + linear in one launch (kernels/norm_linear) against what runs today at 9-32 rows:
the add_rms_norm kernel, then the skinny GEMM (its table entry), on an H200.

Two steps, two machines:
  python bench/norm_linear_device.py prepare .kc/aot_nl   # here, CPU only: sm90 cubins of each config
  python bench/norm_linear_device.py run .kc/aot_nl       # on the GPU: check, then time; JSON to $OUT

Shapes: the 8B's qkv (4096 -> 6144) and gate_up (4096 -> 28672) at M = 16 and 32. Each config is checked
against float64 (and its new residual bit for bit against the rounded sum), then timed as skinny_gemm_device
times (a CUDA graph of 20 calls over weight copies > 400 MB, fastest of 5 replays), launched plainly and with
PDL; the pair today is add_rms_norm + skinny GEMM, both with PDL. Shared memory per program decides how many
programs an SM holds (227 KB an SM): the x and residual tiles take pipeline stages beside W's, so the table
prints it. The last lines: per shape and M, the pair's us and each config's.
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
sys.path.insert(0, str(ROOT / "bench"))

SHAPES = {"qkv": 6144, "gate_up": 28672}
K = 4096
ROWS = {16: "m<=16", 32: "m<=32"}
CONFIGS = {
    "table": {},
    "n64k128s3w4": dict(BLOCK_N=64, BLOCK_K=128, num_stages=3, num_warps=4),
    "n64k64s6w4": dict(BLOCK_N=64, BLOCK_K=64, num_stages=6, num_warps=4),
    "n64k64s4w4": dict(BLOCK_N=64, BLOCK_K=64, num_stages=4, num_warps=4),
    "n128k64s4w8": dict(BLOCK_N=128, BLOCK_K=64, num_stages=4, num_warps=8),
    "n128k64s3w4": dict(BLOCK_N=128, BLOCK_K=64, num_stages=3, num_warps=4),
}


def _cfg():
    from skinny_gemm_device import _cfg as cfg
    return cfg("8b")


def prepare(out: Path):
    import dataclasses
    from engc.compiler.codegen.decode_gemm_specs import norm_linear_specs, skinny_gemm_specs
    from engc.compiler.codegen.record import compile_specs, default_jobs
    from engc.compiler.codegen.specs import rms_norm_specs
    cfg = _cfg()
    t0 = time.time()
    specs = [dataclasses.replace(s, variant=f"{s.variant}@rms") for s in rms_norm_specs(cfg, "bf16", "sm90")]
    for cls in ROWS.values():
        specs += [dataclasses.replace(s, variant=f"{s.variant}@skinny")
                  for s in skinny_gemm_specs(cfg, "bf16", "sm90", classes=(cls,)) if not s.constexprs["SILU"]]
        for tag, ov in CONFIGS.items():
            specs += [dataclasses.replace(s, variant=f"{s.variant}@{tag}")
                      for s in norm_linear_specs(cfg, "bf16", "sm90", {cls: ov} if ov else None, classes=(cls,),
                                                 enabled_only=False)]
    result = compile_specs(specs, jobs=default_jobs())
    for r in result.records:
        (out / r["cubin"]).parent.mkdir(parents=True, exist_ok=True)
        (out / r["cubin"]).write_bytes(result.files[r["cubin"]])
    (out / "records.json").write_text(json.dumps(result.records, indent=1, sort_keys=True))
    print(f"{len(result.records)} kernels in {time.time() - t0:.0f} s -> {out}")


def run(folder: Path, out_dir: Path):
    import torch
    from skinny_gemm_device import Kernels, graph_time, warm_clocks
    from engc.kernels import norm_linear, rms_norm, skinny_gemm
    out_dir.mkdir(parents=True, exist_ok=True)
    k = Kernels(folder)
    records = {r["variant"]: r for r in json.loads((folder / "records.json").read_text())}
    counters = torch.zeros(skinny_gemm.NUM_COUNTERS, dtype=torch.int32, device="cuda")
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    warm_clocks()
    norm_w = (torch.rand(K, device="cuda", generator=g) + 0.5).to(bf)
    for shape, n in SHAPES.items():
        copies = max(2, -(-400_000_000 // (n * K * 2)))
        ws = [(torch.randn(n, K, device="cuda", generator=g) * K ** -0.5).to(bf) for _ in range(copies)]
        for m, cls in ROWS.items():
            x = torch.randn(m, K, device="cuda", generator=g).to(bf)
            r = (torch.randn(m, K, device="cuda", generator=g) * 4).to(bf)
            out = torch.empty(m, n, dtype=bf, device="cuda")
            r_out, normed = torch.empty_like(r), torch.empty_like(r)
            s = x.double() + r.double()
            ref = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()) @ ws[0].double().t()
            sk = skinny_gemm.variant_name(K, False, m) + "@skinny"

            def today(i, pdl=True):
                k.run([("add_rms_norm@rms", grid, args) for _, grid, args in
                       rms_norm.launch(x, norm_w, 1e-5, normed, residual=r, residual_out=r_out)], pdl)
                k.run(skinny_gemm.launch(normed, ws[i % copies], out, sk, k.consts[sk], counters), pdl)
            today(0, False)
            torch.cuda.synchronize()
            case = {"today_err": float((out.double() - ref).abs().max() / ref.abs().max()),
                    "today_us": graph_time(today), "configs": {}}
            for variant in sorted(v for v, rec in records.items() if rec["op"] == "norm_linear"
                                  and v.startswith(norm_linear.variant_name(K, m) + "@")):
                tag, c = variant.split("@")[1], k.consts[variant]

                def fused(i, pdl=False, c=c, variant=variant):
                    k.run(norm_linear.launch(x, r, norm_w, ws[i % copies], 1e-5, out, r_out, variant, c), pdl)
                out.fill_(float("nan"))
                r_out.fill_(float("nan"))
                fused(0)
                torch.cuda.synchronize()
                err = float((out.double() - ref).abs().max() / ref.abs().max())
                exact = bool(torch.equal(r_out, (x.float() + r.float()).to(bf)))
                case["configs"][tag] = {"err": err, "residual_exact": exact, "shared_mem": records[variant]["shared_mem"],
                                        "programs_per_sm": (227 * 1024) // max(1, records[variant]["shared_mem"])}
                if err < 2e-2 and exact:
                    case["configs"][tag]["us"] = graph_time(fused)
                    case["configs"][tag]["pdl_us"] = graph_time(lambda i: fused(i, True))
            res["cases"][f"{shape}_m{m}"] = case
            print(f"{shape} m{m}: today {case['today_us']:.1f} us; " + ", ".join(
                f"{t} {v.get('pdl_us', float('nan')):.1f}" for t, v in case["configs"].items()), flush=True)
        ws = None
        torch.cuda.empty_cache()
    (out_dir / "norm_linear.json").write_text(json.dumps(res, indent=1))
    print(f"\n== norm_linear vs add_rms_norm + skinny GEMM (both PDL), 8B K 4096, us a call, cold L2 ==")
    tags = list(CONFIGS)
    print(f"{'case':12} {'today':>7} " + " ".join(f"{t:>12}" for t in tags))
    for name, case in res["cases"].items():
        cells = []
        for t in tags:
            v = case["configs"].get(t, {})
            cells.append(f"{v['pdl_us']:6.1f}({v['programs_per_sm']})" if "pdl_us" in v else
                         ("FAIL" if v else "-").rjust(12))
        print(f"{name:12} {case['today_us']:7.1f} " + " ".join(c.rjust(12) for c in cells))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("verb", choices=["prepare", "run"])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/engc_norm_linear")))
    args = ap.parse_args()
    prepare(args.folder) if args.verb == "prepare" else run(args.folder, args.out)


if __name__ == "__main__":
    main()
