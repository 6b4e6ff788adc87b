"""The CUDA layer both sides of engc stand on: the driver through engc._native (cubin.py) and a kernel
record loaded as its launch record says (records.py).

The runtime launches a bundle's kernels through it and `engc tune` times candidate kernels through it,
so the compiler never imports the runtime. It imports neither torch at module level nor triton.
"""
