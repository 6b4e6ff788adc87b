"""Why the int4 GEMV's warps stall: the 8B projections at M=1 under Nsight Compute, on an H200.

The GEMV (templates/int4_gemv.cu.j2) spends ~57 us a layer where its W loads alone take ~41 and copy bandwidth
~27 (bench/results/h200_59ba135_int4_variants.txt, h200_889aa03_int4_stream_ablate.txt). ncu's stall reasons
and per-instruction samples say what its warps wait on: the loads (long scoreboard), the mma and dequant
chain (math pipe, wait), or issue.

  INT4_CUDA_SWEEP=w4t2u1b4z,w4t1u2b4z,w4t2u1b4z_a \\
      python bench/int4_cuda_device.py prepare .kc/aot_int4_ncu       # here: the configs' sm90 cubins
  ncu --clock-control none --nvtx --nvtx-include 'ncu/' --set full --import-source no -o $OUT/int4 -f \\
      python3 bench/int4_gemv_ncu.py .kc/aot_int4_ncu $OUT             # on the GPU

Each (config, projection) runs warm on every copy of its weight first, then LAUNCHES times inside the NVTX
range 'ncu' that ncu filters on, each launch on the next copy (the copies exceed L2, so W comes from DRAM as
in a decode step). order.json under OUT lists the profiled launches in order (ncu's IDs follow it).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LAUNCHES = 2


def main(aot: Path, out: Path):
    import torch
    from int4_cuda_device import GROUP, SHAPES, make_weights
    from kernels_device import load_sets, rel_err
    from engc.kernels import gemv
    from engc.kernels import int4_linear as op
    sets = load_sets(aot)
    counters = torch.zeros(gemv.NUM_COUNTERS, dtype=torch.int32, device="cuda")
    packed = op.PackedScales()   # the packed_sz builds' scale / zero words, once a weight
    gen = torch.Generator(device="cuda").manual_seed(0)
    order = []
    for shape, (n, k) in SHAPES.items():
        wbytes = n * k // 2 + 3 * n * (k // GROUP)
        ws = make_weights(n, k, GROUP, max(LAUNCHES + 1, math.ceil(150e6 / wbytes)), gen)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda", generator=gen)
        y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        ref = x.double() @ op.dequantize(*ws[0], GROUP).double().t()
        for name, ks in sets.items():
            consts = ks.consts("int4_linear")

            def launch(w):
                ks.run("int4_linear", op.cuda_launch(x, *w, None, y, group_size=GROUP, consts=consts,
                                                     counters=counters, packed=packed))
            launch(ws[0])
            torch.cuda.synchronize()
            err = rel_err(y, ref)
            for w in ws:
                launch(w)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("ncu")
            for i in range(LAUNCHES):
                launch(ws[1 + i])
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            order += [dict(set=name, shape=shape, N=n, K=k, M=1, wbytes=wbytes, launch=i, check_rel_err=err)
                      for i in range(LAUNCHES)]
            print(f"{name} {shape}: rel err {err:.1e}", flush=True)
        ws = None
        torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    (out / "order.json").write_text(json.dumps(order, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
