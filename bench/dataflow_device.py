"""Would a dataflow kernel stream an int4 decode step's weights at copy speed despite its latency-bound phases?

The question persistent_chain_device.py left (eighteenth session): an 8B int4 b1 step is ~0.45 ms of kernel
boundaries and serialized latency phases (norms, attention) over its ~0.95 ms of weights, and a persistent
kernel with a grid barrier a phase was slower than engc's PDL chain in every form. The form not yet measured:
a producer warp a CTA streams the CTA's share of every phase into a shared-memory ring without waiting on
anything but a free stage, while the consumer warps wait a phase only for the counter of what it reads
(bench/dataflow_micro.cu). Same skeleton as persistent_chain (phases(): the 8B's 32 layers and head, norms as
32 CTAs spinning 1.5 us, the attention 64 CTAs 4.5 us). Forms, one lease:

  ref         persistent_chain's phase_u8 streaming all the GEMV bytes in one launch (the copy ceiling)
  sep_pdl     persistent_chain's one PDL kernel a phase, in a graph (engc's chain today)
  ring        the dataflow kernel without any waits (its streaming alone)
  df          dependencies as in a b1 step: every GEMV waits for all of what it reads; a norm or the attention
              is its own phase on its busy CTAs (one more counter hop)
  df_rnorm    the same, with every CTA recomputing the norm itself (a spin, no hop): the real kernel's choice
  *_nowaits   the phases without the latency phases (hops between GEMVs only)
  sKxS_iI_pP_gG: a ring of S stages of K KB, I producer lanes taking turns at the stages, P bulk copies a
              stage (I 0: no bulk copies, the producer warp's 32 lanes cp.async 16 bytes each an instruction),
              G CTAs an SM (8 consumer warps). The first lease also swept consumer warps, integer work a
              word and poll intervals (h200_b7343be_dataflow_micro.json)

Prediction (before running): ring within 5% of ref (0.94-1.0 ms); df 1.05-1.15 ms and df_rnorm a little less
(against sep_pdl 1.375-1.426 in the eighteenth session): the ring (192 KB ~ 6 us of an SM's stream) covers a
layer's ~5 us attention and hops; w12 with 8 consumer warps within 5% of w0, with 4 slower. If df lands near
1.1 ms, a real dataflow int4 step would be ~1.55 ms (2.65x bf16) and worth building; if near sep_pdl, not.
Measured (H200, bench/results/h200_b7343be_dataflow_micro.json; README, twenty-seventh session): neither.
The ring alone missed copy speed by far, its time growing with the number of stages rather than the bytes
(~0.3 us a stage: 8 KB stages 1,882 us, 32 KB 1,097, ref 971), so the dependency forms (df_rnorm 1,522 at
best) say little yet; sep_pdl 1,389. First find why a CTA's bulk copies do not overlap.

    here:   nvcc -cubin -arch=sm_90a -O3 -o DIR/dataflow.cubin bench/dataflow_micro.cu
            nvcc -cubin -arch=sm_90a -O3 -o DIR/persistent_chain.cubin bench/persistent_chain_micro.cu
    there:  python3 bench/dataflow_device.py DIR OUT.json
"""
import json
import sys

import torch

from engc.cuda import cubin
from event_timing import median_us
from persistent_chain_device import NORM, chain_graph, phases

INT4 = 0.5 + 3 / 128   # bytes a weight: packed int4 g128 with its scales and zeros


def plan(ph: list, grid: int, rnorm: bool) -> dict:
    """The kernel's phase table: kind (0 GEMV, 1 latency phase with a counter, 2 one each CTA runs), the CTAs
    that run it, its spin, the phase whose counter it waits for and the count that counter reaches a launch."""
    t = {k: [] for k in ("kind", "busy", "wait", "dep", "need", "off16", "len16")}
    src, at = -1, 0   # the last phase with a counter (what the next one reads), bytes laid out so far
    adds = []         # each phase's additions to its counter a launch
    for i, (b, c, ns) in enumerate(ph):
        kind = 0 if b else (2 if rnorm and (c, ns) == NORM else 1)
        t["kind"].append(kind)
        t["busy"].append(grid if kind != 1 else c)
        t["wait"].append(ns)
        t["dep"].append(src)
        t["need"].append(adds[src] if src >= 0 else 0)
        t["off16"].append(at // 16)
        t["len16"].append(b // 16)
        at += b
        adds.append(grid if kind == 0 else c if kind == 1 else 0)
        if kind != 2:
            src = i
    t["adds"] = adds
    return t


def main(aot: str, out: str) -> None:
    df_image = open(f"{aot}/dataflow.cubin", "rb").read()
    pc_image = open(f"{aot}/persistent_chain.cubin", "rb").read()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = cubin.current_stream()
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    counters = torch.zeros(256, dtype=torch.int32, device="cuda")
    total = sum(b for b, _, _ in phases(2.0, True))
    buf = torch.empty(total + (1 << 20), dtype=torch.uint8, device="cuda")
    words = buf.view(torch.int32).random_()   # never zeros
    plain = cubin.load_kernel(pc_image, "phase_u8", "plilpii", block_x=128)
    pdl = cubin.load_kernel(pc_image, "phase_u8", "plilpii", block_x=128, pdl=True)
    kernels = {}
    rows = []

    def df_kernel(cw, kb, per_sm):   # the shared-memory split fits per_sm CTAs of a kb ring (+ barriers)
        key = (cw, kb, per_sm)
        if key not in kernels:
            kernels[key] = cubin.load_kernel(df_image, f"dataflow_c{cw}", "ppppppppipIpiiiiiii", block_x=32 * (cw + 1),
                                             shared_mem=kb << 10, carveout=min(100, -(-per_sm * (kb + 3) * 100 // 228)))
        return kernels[key]

    def run_df(ph, rnorm, deps, cw=8, stage_kb=8, stages=24, work=0, poll=0, issuers=1, pieces=1, per_sm=1):
        grid = per_sm * sms
        t = plan(ph, grid, rnorm)
        k = df_kernel(cw, stage_kb * stages, per_sm)
        dev = lambda xs, ty: torch.tensor(xs, dtype=ty, device="cuda")
        args = [dev(t["off16"], torch.int64), dev(t["len16"], torch.int64), dev(t["kind"], torch.int32),
                dev(t["busy"], torch.int32), dev(t["wait"], torch.int64), dev(t["dep"], torch.int32),
                dev(t["need"], torch.int32)]
        epoch = [0]

        def go():
            epoch[0] += 1
            k.launch((grid, 1, 1), [buf, *args, len(ph), counters, epoch[0], sink, stages, (stage_kb << 10) // 16,
                                    deps, work, poll, issuers, pieces], stream)
        counters.zero_()
        us = median_us(go, 12, digits=1, warm=True)
        sink.zero_()
        go()
        torch.cuda.synchronize()
        # every word of every GEMV phase consumed exactly once, no wait gave up, every counter where it should be
        want = sum(int(words[o * 4:(o + n) * 4].sum(dtype=torch.int64)) for o, n in zip(t["off16"], t["len16"]) if n)
        ok = (int(sink[0]) & 0xFFFFFFFF) == (want & 0xFFFFFFFF) and int(sink[2]) == 0
        ok &= counters[:len(ph)].tolist() == [epoch[0] * a for a in t["adds"]]
        return us, ok, int(sink[2])

    for sizes, bpw in (("int4", INT4), ("bf16", 2.0)):
        for waits in (True, False):
            ph = phases(bpw, waits)
            gemv_bytes = sum(b for b, _, _ in ph)
            offs = [o for o in plan(ph, sms, False)["off16"]]
            res = {"ref": (median_us(lambda: plain.launch((4 * sms, 1, 1), [buf, gemv_bytes // 16, 0, 0, sink, 0, 0],
                                                          stream), 12, digits=1, warm=True), True, 0)}
            g = chain_graph(pdl, pdl, ph, offs, buf, sink, 4 * sms, 1)
            res["sep_pdl"] = (median_us(g.replay, 12, digits=1, warm=True), True, 0)
            del g
            res["ring"] = run_df(ph, False, 0)
            res["df"] = run_df(ph, False, 1)
            if waits:
                res["df_rnorm"] = run_df(ph, True, 1)
            if sizes == "int4" and waits:   # do an SM's bulk copies overlap? more issuing lanes, pieces, CTAs
                for skb, st, iss, pcs, per_sm in ((8, 24, 2, 1, 1), (8, 24, 4, 1, 1), (8, 24, 1, 4, 1),
                                                  (16, 12, 4, 1, 1), (16, 12, 1, 4, 1), (32, 6, 4, 1, 1),
                                                  (32, 6, 1, 8, 1), (8, 12, 1, 1, 2), (16, 6, 1, 1, 2),
                                                  (8, 12, 4, 1, 2), (4, 24, 1, 1, 2), (8, 24, 0, 1, 1),
                                                  (16, 12, 0, 1, 1), (4, 48, 0, 1, 1), (8, 12, 0, 1, 2)):
                    tag = f"s{skb}x{st}_i{iss}_p{pcs}_g{per_sm}"
                    res["ring_" + tag] = run_df(ph, False, 0, 8, skb, st, 0, 0, iss, pcs, per_sm)
                    res["df_rnorm_" + tag] = run_df(ph, True, 1, 8, skb, st, 0, 0, iss, pcs, per_sm)
            ref = res["ref"][0]
            for form, (us, ok, err) in res.items():
                rows.append({"sizes": sizes, "waits": waits, "form": form, "us": us, "ok": ok, "err": err,
                             "tb_s": round(gemv_bytes / us / 1e6, 2), "x_ref": round(us / ref, 3),
                             "phases": len(ph), "gemv_mb": round(gemv_bytes / 1e6, 1)})
            print(f"{sizes} waits={waits}: " + ", ".join(f"{f} {v[0]:.0f}{'' if v[1] else ' BAD'}"
                                                           for f, v in res.items()), flush=True)
    json.dump({"gpu": torch.cuda.get_device_name(), "sms": sms, "rows": rows}, open(out, "w"), indent=1)
    print(f"{'sizes':5} {'waits':5} {'form':28} {'us':>8} {'TB/s':>6} {'x ref':>6} ok")
    for r in rows:
        print(f"{r['sizes']:5} {str(r['waits']):5} {r['form']:28} {r['us']:8.1f} {r['tb_s']:6.2f} {r['x_ref']:6.3f} "
              f"{'ok' if r['ok'] else 'BAD ' + str(r['err'])}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
