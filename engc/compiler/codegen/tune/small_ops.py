"""Tune entries of the small per-row kernels: RMSNorm, QK-norm, rotary, SiLU-and-mul, sampling, argmax."""
from __future__ import annotations

from engc.compiler.codegen.tune.table import put

for _arch in ("sm80", "sm90"):
    for _bucket, _warps in (("block<=1024", 4), ("block<=4096", 8), ("block>4096", 16)):
        put(_arch, "rms_norm", "*", _bucket, num_warps=_warps, num_stages=1)
        put(_arch, "qk_norm", "*", _bucket, num_warps=_warps, num_stages=1)
        put(_arch, "rotary", "*", _bucket, num_warps=_warps, num_stages=1)
    # the AddRMSNorm summing an int4 GEMV's split-K partials (QLinearAddRMSNorm): at M=1 one CTA reading four fp32
    # partials, 64 KB for the 8B, took 2.30 us a launch in the int4 b1 chain against 1.13 for the plain add_rms_norm
    # (bench/results/README.md, twenty-first session). 16 warps for hidden 1025-4096 (twenty-second session, one
    # lease, stock-w16-w32-stock, bench/results/h200_a1f4821_norm_partials_warps.json): int4 + int4 head b1
    # 1.867 ms (w16) and 1.866 (w32) against 1.875 / 1.876 with 8; the sum of squares then reduces in another
    # order than the plain add_rms_norm's 8 warps (a last-bit difference in rstd where the fp32 sums differ)
    for _bucket, _warps in (("block<=1024", 4), ("block<=4096", 16), ("block>4096", 16)):
        put(_arch, "rms_norm", "add_rms_norm_partials", _bucket, num_warps=_warps, num_stages=1)
    put(_arch, "silu_mul", "*", "any", BLOCK=1024, num_warps=4, num_stages=1)
    put(_arch, "sampling", "*", "any", BLOCK_V=4096, num_warps=8, num_stages=1)
    put(_arch, "argmax", "*", "any", block=1024, max_splits=64, num_warps=4, num_stages=1)
