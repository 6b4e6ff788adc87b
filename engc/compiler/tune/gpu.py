"""`engc tune --from DIR` on this machine's GPU: load the candidates' cubins (compiled by `engc tune --prepare`
where bundles are built) through engc.cuda, the launcher bundles load through too (no Triton compile here),
check each against the torch reference, time it over cold L2.

Timing: each shape cycles through enough copies of its weight to overflow L2 (3x its size), as a decode
step's weights do; the launches are captured in one CUDA graph (decode steps replay graphs too, so launch
gaps are as in serving) and the figure is the median over replays, in us per launch. Each launch follows a
one-element kernel launched without PDL, so it starts from an idle GPU, as a projection starts after a norm
or the attention in a step; that kernel's own time (timed alone the same way) is taken off. Back to back,
one launch's ramp-up would hide behind the tail of the one before, and a ranking made that way does not
hold in a real step (bench/results/HISTORY.md). The MoE op's candidates (a class's gate_up and down launched
as a pair, gpu_moe.py) are timed the same way.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engc.compiler.tune import plan as tp
from engc.errors import UserError
from engc.kernels.silu_mul import silu_mul

REL_TOL = 1e-2    # bf16 GEMV vs torch: the split and accumulation orders differ, the products do not
MIN_LAUNCHES = 64
REPLAYS = 7


def local_gpu() -> tuple[str, str, int]:
    """(arch, name, multiprocessors) of the GPU this process would time on, or one clear line why not."""
    from engc.compiler import tune
    from engc.cuda import cubin
    if not torch.cuda.is_available():
        raise UserError("engc tune times kernels on this machine's GPU, and torch sees no CUDA GPU here "
                        "(run it on the GPU you will serve on, then build anywhere with --tune)")
    if not cubin.cuda_available():
        raise UserError(f"engc tune launches kernels through engc._native: {cubin.cuda_unavailable_reason()}")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    arch = f"sm{props.major}{props.minor}"
    if arch not in tune.ARCHS:
        raise UserError(f"this GPU ({props.name}) is {arch}; engc builds kernels for {', '.join(tune.ARCHS)} "
                        "only, so it has no tune table to measure")
    return arch, props.name, props.multi_processor_count


def load_record(image: bytes, r: dict, say):
    """One kernel record's cubin, loaded as a bundle's are (engc.cuda.records.load_record: PDL where the record
    asks for it, unless ENGC_DEBUG has no-pdl); None, said, where the driver refuses it."""
    from engc.cuda import records
    try:
        return records.load_record(image, r, records.pdl_enabled())
    except Exception as e:  # noqa: BLE001 -- the driver's refusal of one image fails that candidate only
        say(f"LOAD FAILED {r['variant']} {r['tune']}: {str(e).splitlines()[0][:200]}")
        return None


def load_candidates(prep, say, load=load_record) -> dict:
    """(shape, cand) -> (Kernel, record) for every candidate with a kernel ([(Kernel, record), ...] for a
    candidate of several: moe); each cubin file loaded once (candidates that differ in a launch constant only
    share it), its sha256 checked first. A candidate one of whose kernels the driver refuses is left out."""
    loaded, out = {}, {}

    def kernel(record):
        if record["cubin"] not in loaded:
            loaded[record["cubin"]] = load(prep.cubin(record), record, say)
        return loaded[record["cubin"]]

    for key, record in prep.records.items():
        if record is None:
            continue   # cuBLAS, or a config that did not compile at --prepare
        if isinstance(record, list):
            parts = [(kernel(r), r) for r in record]
            if all(k is not None for k, _ in parts):
                out[key] = parts
        elif kernel(record) is not None:
            out[key] = (kernel(record), record)
    return out


class GpuBench:
    """ready(shape, cand), check(shape, cand) -> relative error, time_us(shape, cand) -> us per launch, over
    the cubins of a tune-prepare folder (prepared.py)."""

    def __init__(self, prep, say):
        self.plan, self.say = prep.plan, say
        # first, so torch's CUDA context exists: the cubins load into it
        from engc.kernels.gemv import NUM_COUNTERS
        self.counters = torch.zeros(NUM_COUNTERS, dtype=torch.int32, device="cuda")
        self.kernels = load_candidates(prep, say)
        self._shape, self._bufs = None, None
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 50 << 20
        self.ring_bytes = 3 * l2
        self.gap = torch.zeros(1, device="cuda")   # the one-element kernel each timed launch follows
        self.gap_us = self._graph_us([lambda: None])
        self.moe = None
        if any(s.op == tp.moe.OP for s in self.plan.shapes):
            from engc.compiler.tune.gpu_moe import MoeBench
            self.moe = MoeBench(self.plan, self.kernels, self.ring_bytes)

    def ready(self, shape, cand) -> bool:
        return cand.bucket is None or (shape, cand) in self.kernels

    # -------------------------------------------------------------------------------------- per shape
    def _buffers(self, shape: tp.Shape):
        if self._shape != shape:
            self._bufs = None
            torch.cuda.empty_cache()
            dt, k, n = self.plan.dtype, shape.k, shape.n
            w_bytes = n * k * torch.finfo(dt).bits // 8
            copies = max(1, min(64, math.ceil(self.ring_bytes / w_bytes)))
            gen = torch.Generator(device="cuda").manual_seed(0)
            ws = [(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dt) for _ in range(copies)]
            silu = shape.op == "silu_gemv"
            x = torch.randn(1, 2 * k if silu else k, device="cuda", generator=gen).to(dt)
            # cuBLAS runs on the ready activation (the fallback also launches silu_mul for the down)
            act = silu_mul(x) if silu else x
            self._bufs = dict(ws=ws, x=x, act=act, out=torch.empty(1, n, dtype=dt, device="cuda"))
            self._shape = shape
        return self._bufs

    def _launches(self, shape, cand, i: int):
        """One launch function per weight copy i (the split partials allocated now, outside the graph)."""
        from engc.kernels import gemv
        from engc.cuda.cubin import current_stream
        b = self._buffers(shape)
        if cand.bucket is None:
            return lambda: F.linear(b["act"], b["ws"][i])
        kernel, r = self.kernels[(shape, cand)]
        plan = [(grid, kernel.pointers(args), args) for _, grid, args in gemv.launch(
            b["x"], b["ws"][i], b["out"], r["variant"], r["launch"], self.counters)]

        def run():
            for grid, ptrs, _ in plan:   # (args kept alive with the plan: they own the split partials)
                kernel.launch(grid, ptrs, current_stream())
        return run

    def check(self, shape, cand) -> float:
        """Relative error of one launch against the op's torch reference (inf: counters left non-zero)."""
        from engc.kernels import gemv
        if shape.op == tp.moe.OP:
            return self.moe.check(shape, cand)
        if cand.bucket is None:
            return 0.0   # cuBLAS (F.linear) is the reference's own path
        b = self._buffers(shape)
        ref = (gemv.silu_mul_linear(b["x"], b["ws"][0]) if shape.op == "silu_gemv"
               else gemv.gemv(b["x"], b["ws"][0])).float()
        b["out"].fill_(float("nan"))
        self._launches(shape, cand, 0)()
        torch.cuda.synchronize()
        if int(self.counters.abs().sum().item()):
            self.counters.zero_()
            return float("inf")
        return float((b["out"].float() - ref).norm() / ref.norm())

    def time_us(self, shape, cand) -> float:
        """us a launch adds after an idle gap (see the module's docstring)."""
        if shape.op == tp.moe.OP:
            fns = self.moe.launches(shape, cand)
            return self._graph_us(fns, tp.moe.MIN_LAUNCHES) - self.gap_us
        b = self._buffers(shape)
        return self._graph_us([self._launches(shape, cand, i) for i in range(len(b["ws"]))]) - self.gap_us

    def _graph_us(self, fns, min_launches: int = MIN_LAUNCHES) -> float:
        """Median us per (gap kernel, fns[j]) pair over graph replays, cycling through fns."""
        n = math.ceil(min_launches / len(fns)) * len(fns)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm up outside capture (cuBLAS picks its kernel here)
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for j in range(n):
                self.gap.add_(1.0)   # torch's kernel: no PDL, so the next launch cannot start before it ends
                fns[j % len(fns)]()
        graph.replay()
        times = []
        for _ in range(REPLAYS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / n)
        del graph
        return sorted(times)[len(times) // 2]
