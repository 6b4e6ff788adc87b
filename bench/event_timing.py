"""Median CUDA-event time of a launch sequence, for the device micro benchmarks (run as bench/X.py, so this
module is on the path)."""
import statistics

import torch


def median_us(fn, reps: int = 15, before=None, digits: int = 2, warm: bool = False) -> float:
    """Median microseconds of fn() between two events over reps runs; before() runs outside the timing
    ahead of each (an L2 flush); warm: one untimed fn() first."""
    if warm:
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return round(statistics.median(times), digits)
