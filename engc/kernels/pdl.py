"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (sm90 and newer).

A decode step is a few hundred short kernels; each waits for the one before to end, then pays its own
launch and ramp-up. Launched with PDL (runtime: the record's launch constant PDL=1, engc._native.set_pdl),
a kernel may start while the previous one in the stream is still running: `wait()` then blocks until
that kernel has finished and its writes are visible, and `launch_dependents()` lets the next PDL kernel
start. A kernel built with PDL=1 must call wait() before it reads or writes any memory another kernel
touches (only constant weights may be read before); launched without PDL, both calls are no-ops.
One documented exception: decode attention at EARLY_KV=2 (paged_attention/triton.py) reads the step's
metadata and the cached K/V of earlier tokens before wait(). Every PDL kernel here calls
launch_dependents() only after its own wait(), so when a kernel starts, the kernel two launches back has
finished; what it reads early was written before that (staged metadata, earlier steps' cache rows), and
the one kernel that may still run (the QKV projection) writes only qkv, which it reads after wait().

Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) has no such instructions: there both are empty.
Only the compiler imports this module (through the kernels' triton.py files).
"""
import os

import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1":
    @triton.jit
    def wait(PDL: tl.constexpr):
        pass

    @triton.jit
    def launch_dependents(PDL: tl.constexpr):
        pass
else:
    from triton.language.extra import cuda as _cuda

    @triton.jit
    def wait(PDL: tl.constexpr):
        if PDL:
            _cuda.gdc_wait()

    @triton.jit
    def launch_dependents(PDL: tl.constexpr):
        if PDL:
            _cuda.gdc_launch_dependents()
