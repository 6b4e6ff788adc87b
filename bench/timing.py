"""GPU timing for the benchmark and for one-off measurements: wall time between synchronizes, CUDA-graph
replays, CUDA-event medians, a clock warm-up, and the H200 rooflines figures are reported against.

Run a script as `python bench/X.py` so this module is on the path.
"""
from __future__ import annotations

import statistics
import time

COPY_BW = 4.25e12    # bytes/s: the H200's device-to-device copy, what a decode step's weight reads can reach
GEMM_PEAK = 793e12   # bf16 FLOP/s: cuBLAS's best large GEMM on the H200, what a long prefill can reach


def synced(fn):
    """(fn(), seconds it took), the GPU synchronized before and after, so queued work counts."""
    import torch
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def graph_replay_ms(graph, reps: int = 100, warm: int = 5) -> float:
    """Milliseconds a replay of a captured CUDA graph, over reps back-to-back replays after warm ones."""
    for _ in range(warm):
        graph.replay()
    _, t = synced(lambda: [graph.replay() for _ in range(reps)])
    return round(t * 1000 / reps, 3)


def median_event_us(fn, reps: int = 15, before=None, digits: int = 2, warm: bool = False) -> float:
    """Median microseconds of fn() between two CUDA events over reps runs (for launches too short for wall
    time); before() runs outside the timing ahead of each (e.g. an L2 flush); warm: one untimed fn() first."""
    import torch
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


def warm_clocks(seconds: float = 1.0) -> None:
    """Keep the GPU busy with bf16 GEMMs for `seconds`: an idle GPU's clocks ramp up over the first
    hundreds of milliseconds of work, so a kernel timed cold reads slower than it runs in a busy engine."""
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def frac_of_copy_roofline(bytes_per_s: float) -> float:
    return round(bytes_per_s / COPY_BW, 3)


def frac_of_gemm_peak(flops_per_s: float) -> float:
    return round(flops_per_s / GEMM_PEAK, 3)


# nvidia-smi's clocks_event_reasons bits that slow a busy GPU (the rest: idle, application clocks, ...)
SLOWDOWNS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}


class GpuClocks:
    """The SM clock, power and temperature nvidia-smi reads every 100 ms while the `with` block runs, and why the
    clocks were held down: a figure measured at full load on a shared machine can differ by 1.5x from one run
    to the next when the card hits its power or thermal limit, and this says whether it did. `summary` is {}
    where nvidia-smi is missing."""

    def __enter__(self):
        import subprocess
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True)
        except OSError:
            self._proc = None
        return self

    def __exit__(self, *exc):
        self.summary = {}
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate()
        rows = []
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                rows.append((float(parts[0]), float(parts[1]), float(parts[2]), int(parts[3], 16)))
            except (ValueError, IndexError):
                continue
        if rows:
            clocks = [r[0] for r in rows]
            mask = 0
            for r in rows:
                mask |= r[3]
            self.summary = {"sm_mhz_min": min(clocks), "sm_mhz_median": statistics.median(clocks),
                            "power_w_max": max(r[1] for r in rows), "temp_c_max": max(r[2] for r in rows),
                            "slowed_by": [name for bit, name in SLOWDOWNS.items() if mask & bit]}
