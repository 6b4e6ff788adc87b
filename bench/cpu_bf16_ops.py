"""Where a bfloat16 bundle's CPU step spends its time: torch's matmul on SmolLM2-135M's projection shapes in
bfloat16 against float32 (weights held in float32, the result rounded to bfloat16), whether the two agree bit
for bit, and the cost of the casts. Run on the CPU to be described: python3 bench/cpu_bf16_ops.py [threads]."""
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def per_call(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def main():
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    print("torch", torch.__version__, "threads", torch.get_num_threads(), "capability",
          torch.backends.cpu.get_cpu_capability())
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 37):
        for name, (k, n) in SHAPES.items():
            x = torch.randn(rows, k, generator=gen).bfloat16()
            w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
            xf, wf = x.float(), w.float()
            reps = 20 if n > 10000 else 200
            bf16 = per_call(lambda: F.linear(x, w), reps)
            f32 = per_call(lambda: F.linear(x.float(), wf).bfloat16(), reps)
            cast_w = per_call(lambda: w.float(), reps)
            same = int((F.linear(x, w) != F.linear(xf, wf).bfloat16()).sum())
            print(f"M={rows:3d} {name:8s} K={k:5d} N={n:6d}  bf16 {bf16:8.3f} ms  f32+round {f32:8.3f} ms"
                  f"  w.float() {cast_w:7.3f} ms  differing {same}/{rows * n}")


if __name__ == "__main__":
    main()
