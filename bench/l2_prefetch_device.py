"""Does an L2 prefetch issued by a short kernel hold that kernel up, and does the reader after it hit L2?

The question behind the L2 prefetch experiment of 803114d..a863053 (reverted; bench/results/README.md,
seventeenth session): the cluster decode kernel asked L2 for the weights the step reads next (the o
projection, then the MLP's) from a per-layer table, and every budget made the int4 8B step slower. Here, on
the GPU (kernels from bench/l2_prefetch_micro.cu, compiled where the cubin is made):

    here:   nvcc -cubin -arch=sm_90a -O3 -o .kc/l2_micro.cubin bench/l2_prefetch_micro.cu
    there:  python3 bench/l2_prefetch_device.py .kc/l2_micro.cubin OUT.json

For each mode (none; cp.async.bulk.prefetch.L2 in 4 KB chunks; prefetch.global.L2 a line; the same with
evict_last) and size, a 64 x 128-thread `window` kernel (the attention's grid) issues the prefetch and spins
for 0 or 5 us, then `stream_read` (132 x 4 CTAs, the GEMV's load instruction) reads the buffer. Times by
CUDA events (each ~3 us over the kernels), L2 flushed before each, median of 15.
"""
import json
import sys

import torch

from engc.cuda import cubin
from event_timing import median_us


def main(path: str, out: str) -> None:
    image = open(path, "rb").read()
    window = cubin.load_kernel(image, "window", "plil", block_x=128)
    read = cubin.load_kernel(image, "stream_read", "plp", block_x=128)
    flush = cubin.load_kernel(image, "flush", "pl", block_x=256)
    stream = cubin.current_stream()
    junk = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    buf = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda")

    def timed(fn, reps=15):
        return median_us(fn, reps, before=lambda: flush.launch((132 * 8, 1, 1), [junk, junk.numel() // 16], stream))

    rows = []
    for mb in (8, 24):
        n = mb << 20
        cold = timed(lambda: read.launch((132 * 4, 1, 1), [buf, n // 16, sink], stream))

        def warm_read():
            read.launch((132 * 4, 1, 1), [buf, n // 16, sink], stream)
        warm = timed(lambda: (warm_read(), warm_read())) - cold
        rows.append({"mb": mb, "what": "read cold / read after a read", "us": [cold, round(warm, 2)]})
        for mode in (0, 1, 2, 3):
            for spin in (0, 5000):
                alone = timed(lambda: window.launch((64, 1, 1), [buf, n, mode, spin], stream))
                both = timed(lambda: (window.launch((64, 1, 1), [buf, n, mode, spin], stream),
                                      read.launch((132 * 4, 1, 1), [buf, n // 16, sink], stream)))
                rows.append({"mb": mb, "mode": ["none", "bulk4k", "line", "line_evict_last"][mode], "spin_us": spin / 1000,
                             "window_us": alone, "window_then_read_us": both, "read_part_us": round(both - alone, 2)})
                print(rows[-1], flush=True)
    print(f"{'MB':>3} {'mode':>16} {'spin':>5} {'window':>8} {'+read':>8} {'read part':>9}")
    for r in rows:
        if "mode" in r:
            print(f"{r['mb']:>3} {r['mode']:>16} {r['spin_us']:>5} {r['window_us']:>8} {r['window_then_read_us']:>8} "
                  f"{r['read_part_us']:>9}")
        else:
            print(r)
    json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
