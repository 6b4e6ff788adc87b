"""What do a decode step's kernel boundaries cost, and would one persistent kernel stream its weights faster?

The lever note17 names for the two open must-shows (int4 8B batch 1 at 2.5x bf16, 8B batch 32 at 6,500
tok/s): engc's step is 7 dependent launches a layer (norm, QKV GEMV, attention, o GEMV, norm, gate_up GEMV,
down GEMV), each ramping up and draining, and between the GEMVs short latency-bound kernels (norms, the
decode attention) leave DRAM idle. Here only that skeleton runs (bench/persistent_chain_micro.cu): GEMV
phases stream their bytes once with the GEMVs' load instruction; wait phases spin some CTAs (32 for a norm,
1.5 us; 64 for the attention, 4.5 us: the cluster decode's grid and time at 8B b1). Forms:

  ref            one kernel streaming every GEMV phase's bytes at once (no boundaries: the ceiling)
  sep_plain      one kernel a phase in a CUDA graph, no PDL
  sep_pdl        the same with PDL, each kernel waiting first (engc's kernels)
  sep_pdl_early  PDL, each GEMV's first round of loads issued before its wait
  sep_pdl_smem{K} PDL, each GEMV CTA copying the first K KB of its share (all of it for o and QKV) into
                 shared memory before its wait, so a GEMV behind a wait phase loads during it
  pers           one persistent kernel, a grid barrier between phases (phase table in shared memory)
  pers_regs      + each CTA starts the next GEMV phase's first round (registers) before each barrier
  pers_smem{K}   + instead copies the first K KB of its next share into shared memory (cp.async), held
                 across wait phases: the DRAM-idle windows fill with the next weights
  pers_red*, pers_sleep*  the barrier's arrival by red.release, its polls 100 ns apart

Sizes: the int4 (g128, 0.5234 bytes a weight) and bf16 8B projections, 32 layers, and the head.
Prediction (before running): sep_pdl at int4 sizes with waits ~15-25% slower than ref (the real step's
projection GEMVs take 1.31-1.38 ms loads alone against ~0.95 at copy speed); pers_smem within ~5% of ref;
at bf16 sizes the forms differ less (phases 4x longer).
Measured (H200, bench/results/h200_persistent_chain_micro.json; README, eighteenth session): the prediction
held for sep_pdl (int4 with waits 1.375-1.426 ms against ref 0.935-1.006: 0.45 ms of the ~1.9 ms int4 step
is boundaries and serialized waits; without the waits 1.10-1.16) but not for the persistent forms: every one
slower than sep_pdl (int4 1.82-2.41 ms), the barrier alone 1.7 us against 0.63 us for an empty PDL kernel.
sep_pdl_smem24 took 37-64 us off sep_pdl: the waits stay mostly serialized.

    here:   nvcc -cubin -arch=sm_90a -O3 -o .kc/persistent_chain.cubin bench/persistent_chain_micro.cu
    there:  python3 bench/persistent_chain_device.py .kc/persistent_chain.cubin OUT.json
"""
import json
import sys

import torch

from engc.cuda import cubin
from event_timing import median_us

LAYERS = 32
SHAPE = dict(hidden=4096, inter=14336, q=4096, kv=1024, vocab=128256)
NORM = (32, 1500)     # (CTAs, ns) of a wait phase standing for an RMSNorm
ATTN = (64, 4500)     # ... for the decode attention


def phases(bytes_per_weight: float, waits: bool) -> list[tuple[int, int, int]]:
    """[(bytes, busy CTAs, wait ns)] of one decode step: bytes 0 = a wait phase."""
    h, i, q, kv, v = SHAPE["hidden"], SHAPE["inter"], SHAPE["q"], SHAPE["kv"], SHAPE["vocab"]
    gemv = lambda n, k: (int(n * k * bytes_per_weight) // 16 * 16, 0, 0)
    wait = lambda what: [(0, *what)] if waits else []
    layer = (wait(NORM) + [gemv(q + 2 * kv, h)] + wait(ATTN) + [gemv(h, q)] + wait(NORM)
             + [gemv(2 * i, h), gemv(h, i)])
    return layer * LAYERS + wait(NORM) + [gemv(v, h)]


def chain_graph(kernel, waiter, ph, offs, buf, sink, grid: int, mode: int, kb: int = 0):
    """The step as one phase_u* launch a phase (`kernel` for a GEMV, `waiter` for a wait phase), in a graph."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        s = cubin.current_stream()
        for (b, c, t), o in zip(ph, offs):
            if b:
                kernel.launch((grid, 1, 1), [buf[o * 16:], b // 16, 0, 0, sink, mode, (kb << 10) // 16], s)
            else:   # a wait phase (of no CTA busy: an empty kernel of one CTA)
                waiter.launch((max(c, 1), 1, 1), [buf, 0, c, t, sink, mode, 0], s)
    return g


def main(path: str, out: str) -> None:
    image = open(path, "rb").read()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = 4 * sms
    stream = cubin.current_stream()
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    total = sum(b for b, _, _ in phases(2.0, False))
    buf = torch.empty(total + (1 << 20), dtype=torch.uint8, device="cuda")   # contents do not matter
    rows, epoch = [], [0]

    def timed(fn, reps=12):
        return median_us(fn, reps, digits=1, warm=True)

    for u in (4, 8):
        plain = cubin.load_kernel(image, f"phase_u{u}", "plilpii", block_x=128)
        pdl = cubin.load_kernel(image, f"phase_u{u}", "plilpii", block_x=128, pdl=True)
        pdl_smem = {kb: cubin.load_kernel(image, f"phase_u{u}", "plilpii", block_x=128, pdl=True, shared_mem=kb << 10,
                                          carveout=min(100, -(-4 * (kb + 1) * 100 // 228))) for kb in (24, 48)}
        # The L1/shared split set to what 4 CTAs an SM need (table 8 KB + stash, +1 KB each): left to the
        # driver, the 8 KB table alone made every persistent form 25-80% slower (less L1 for loads in flight)
        pers = {kb: cubin.load_kernel(image, f"persistent_u{u}", "pppppipIpiii", block_x=128, shared_mem=kb << 10,
                                      carveout=min(100, -(-4 * (kb + 9) * 100 // 228)))
                for kb in (0, 24, 48)}
        regs = pers[0].attributes()["num_regs"]

        def resident(kb):   # CTAs an SM can hold at once: registers (256 a warp granule) and shared memory
            per_cta = -(-regs * 32 // 256) * 256 * 4
            static = 256 * 32   # the phase table (MAX_PHASES rows)
            return min(4, 65536 // per_cta, (228 << 10) // ((kb << 10) + static + 1024))
        for name, bpw in (("int4", 0.5 + 3 / 128), ("bf16", 2.0), ("empty", 0.0)):
            for waits in ((True, False) if bpw else (True,)):
                ph = phases(bpw, waits) if bpw else [(0, 0, 0)] * len(phases(1.0, True))
                assert len(ph) <= 256   # MAX_PHASES of the persistent kernel
                gemv_bytes = sum(b for b, _, _ in ph)
                offs, at = [], 0
                for b, _, _ in ph:
                    offs.append(at // 16)
                    at += b
                dev = lambda xs, t: torch.tensor(xs, dtype=t, device="cuda")
                off16, len16 = dev(offs, torch.int64), dev([b // 16 for b, _, _ in ph], torch.int64)
                busy, wait_ns = dev([c for _, c, _ in ph], torch.int32), dev([t for _, _, t in ph], torch.int64)
                res = {}
                res["ref"] = timed(lambda: plain.launch((grid, 1, 1), [buf, max(gemv_bytes // 16, 1), 0, 0, sink, 0, 0],
                                                        stream))

                for form, kernel, mode, kb in (("sep_plain", plain, 0, 0), ("sep_pdl", pdl, 1, 0),
                                               ("sep_pdl_early", pdl, 2, 0), ("sep_pdl_smem24", pdl_smem[24], 3, 24),
                                               ("sep_pdl_smem48", pdl_smem[48], 3, 48)):
                    waiter = plain if kernel is plain else pdl   # wait phases: no shared memory
                    g = chain_graph(kernel, waiter, ph, offs, buf, sink, grid, mode, kb)
                    res[form] = timed(g.replay)
                    del g

                barriers_ok = True
                for form, prefetch, kb, bmode in (("pers", 0, 0, 0), ("pers_regs", 1, 0, 0), ("pers_smem24", 2, 24, 0),
                                                  ("pers_smem48", 2, 48, 0), ("pers_red", 0, 0, 1),
                                                  ("pers_red_smem48", 2, 48, 1), ("pers_sleep", 0, 0, 2),
                                                  ("pers_sleep_regs", 1, 0, 2), ("pers_sleep_smem48", 2, 48, 2)):
                    pgrid = resident(kb) * sms   # every CTA resident at once, or the barriers cannot meet

                    def go():
                        epoch[0] += 1
                        pers[kb].launch((pgrid, 1, 1), [buf, off16, len16, busy, wait_ns, len(ph), counter,
                                                        epoch[0], sink, prefetch, (kb << 10) // 16, bmode], stream)
                    counter.zero_()
                    epoch[0] = 0
                    res[form] = timed(go)
                    torch.cuda.synchronize()
                    # every barrier of every launch counted once per CTA: none gave up
                    barriers_ok &= int(counter.item()) == epoch[0] * (len(ph) - 1) * pgrid
                    res[form + "_grid"] = pgrid
                ref = res["ref"]
                grids = {f[:-5]: res.pop(f) for f in list(res) if f.endswith("_grid")}
                for form, us in res.items():
                    rows.append({"u": u, "sizes": name, "waits": waits, "form": form, "us": us,
                                 "tb_s": round(gemv_bytes / us / 1e6, 2), "x_ref": round(us / ref, 3),
                                 "us_per_boundary": round(us / (len(ph) - 1), 3),
                                 "phases": len(ph), "gemv_mb": round(gemv_bytes / 1e6, 1),
                                 "grid": grids.get(form, grid), "persistent_regs": regs,
                                 "barriers_ok": barriers_ok})
                print(f"u{u} {name} waits={waits}: " + ", ".join(f"{f} {us:.0f}" for f, us in res.items())
                      + f" us (barriers ok: {barriers_ok})", flush=True)
    json.dump({"gpu": torch.cuda.get_device_name(), "sms": sms, "grid": grid, "rows": rows}, open(out, "w"),
              indent=1)
    print(f"{'sizes':5} {'waits':5} {'u':>2} {'form':16} {'us':>8} {'TB/s':>6} {'x ref':>6}")
    for r in rows:
        print(f"{r['sizes']:5} {str(r['waits']):5} {r['u']:2} {r['form']:16} {r['us']:8.1f} {r['tb_s']:6.2f} "
              f"{r['x_ref']:6.3f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
