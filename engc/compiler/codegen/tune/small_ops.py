"""Tune entries of the small per-row kernels: RMSNorm, QK-norm, rotary, SiLU-and-mul, sampling, argmax."""
from __future__ import annotations

from engc.compiler.codegen.tune.table import put

for _arch in ("sm80", "sm90"):
    for _bucket, _warps in (("block<=1024", 4), ("block<=4096", 8), ("block>4096", 16)):
        put(_arch, "rms_norm", "*", _bucket, num_warps=_warps, num_stages=1)
        put(_arch, "qk_norm", "*", _bucket, num_warps=_warps, num_stages=1)
        put(_arch, "rotary", "*", _bucket, num_warps=_warps, num_stages=1)
    # the AddRMSNorm summing an int4 GEMV's split-K partials (QLinearAddRMSNorm): the '*' entry's warps, spelled
    # out for an A/B of more (at M=1 it is one CTA reading four fp32 partials, 64 KB for the 8B, and took 2.30 us
    # a launch in the int4 b1 chain against 1.13 for the plain add_rms_norm: bench/results/README.md, twenty-first
    # session); not yet measured with more
    for _bucket, _warps in (("block<=1024", 4), ("block<=4096", 8), ("block>4096", 16)):
        put(_arch, "rms_norm", "add_rms_norm_partials", _bucket, num_warps=_warps, num_stages=1)
    put(_arch, "silu_mul", "*", "any", BLOCK=1024, num_warps=4, num_stages=1)
    put(_arch, "sampling", "*", "any", BLOCK_V=4096, num_warps=8, num_stages=1)
    put(_arch, "argmax", "*", "any", block=1024, max_splits=64, num_warps=4, num_stages=1)
