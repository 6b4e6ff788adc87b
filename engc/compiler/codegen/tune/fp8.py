"""Tune entries of the FP8 path (--quant fp8): per-token activation quantization and the W8A8 GEMM."""
from __future__ import annotations

from engc.compiler.codegen.tune.table import SM_COUNT, put

# fp8_quant (per-token activation quantization) holds a whole row in registers: warps grow with the row.
# PDL (wait first, kernels/pdl.py) on here and in fp8_linear's m<=16 entry, off in its wider entries. H200, 8B
# fp8, same lease (bench/results/h200_3b0b224_fp8_fusion_pdl_ab.json): on in every fp8 entry
# (bench/ab/fp8_pdl.json) b1 362.8 tok/s against 343.1 (graph 2.757 against 2.917 ms), but b32 7,897 against
# 7,975 and b64 12,343 against 12,637; on for b1 only (bench/ab/fp8_pdl_m16.json, h200_2bd89e5_fp8_pdl_b1.json)
# b1 362.0 / 362.2 against 342.5 / 342.6, b32 7,971 against 7,993 (graph 3.618 against 3.631 ms), b64
# 12,563 / 12,639 against 12,608 / 12,643: the b1 gain, nothing lost above.
for _bucket, _warps in (("block<=1024", 4), ("block<=4096", 8), ("block>4096", 16)):
    put("sm90", "fp8_quant", "*", _bucket, num_warps=_warps, num_stages=1, PDL=1)
# fp8_linear (W8A8 GEMM, kernels/fp8_linear) for --quant fp8 bundles, one entry per M class; prefill above
# the last class stays with fp8_quant + torch._scaled_mm. Not yet measured: bench/fp8_device.py times these
# against _scaled_mm and sweeps BLOCK_N/BLOCK_K/stages/target_programs at M=64. Chosen for bandwidth: W
# tiles of 16 KB over 4-5 stages, shared memory for 2 programs per SM, at least one program per SM (split-K
# where N / BLOCK_N is short; the grid then fits in one wave), the token dim (BLOCK_M >= 16, the narrow
# side of the swapped wgmma) padded to the class. fuse_quant: also build the variant that quantizes x
# itself, used for M in this class: every program then reads all of x [M, K] bf16 once more from L2,
# cheap only for a few rows (kernels/fp8_linear/triton.py).
# Measured on the H200 (bench/fp8_device.py, 2026-11-30; bench/results/h200_fp8_kernels_v2.txt): quantizing
# x inside the GEMM (fuse_quant) was 3-5x slower than fp8_quant + this GEMM even at M=1, so it is off; at M=1
# fp8_quant + GEMM beat bf16 on every 8B projection (qkv 12.3 vs 15.3 us, down 22.8 vs 31.6); at M=64 the
# sweep's best tile was BLOCK_N 64 x BLOCK_K 128 over 4 stages (qkv 15.4, o 16.8, gate_up 35.2, down 27.8 us);
# at M=256 this GEMM lost badly to _scaled_mm (qkv 103 vs 17 us), so rows above 64 take fp8_quant + _scaled_mm.
# Why qkv/o ran at ~1.3 TB/s at M=32-64 (3.3-3.9 TB/s for gate_up, and for every projection at M=1 with
# BLOCK_K 256): too few weight bytes in flight. 96 or 64 N tiles x 2-4 splits put ~1.5-2 programs on an
# SM, each with 3 W tiles of 8 KB ahead (an x tile as large as the W tile takes the other half of the
# shared memory at BLOCK_N 64, M 64), ~4.6 MB in flight over the GPU; gate_up's 448 tiles fill 3 programs
# an SM (~9.5 MB). m<=32/m<=64 now take BLOCK_N 128 (W 16 KB a stage, x half of that: 2 warpgroups) over 4
# stages, 96 KB: 2 programs an SM, and the split rule fills the 264 slots (kernels/fp8_linear
# split_count, any split count: qkv 48 tiles x5, o 32 x8, down 32 x8, gate_up 224 x1), ~11 MB in flight.
# Chosen by that arithmetic, not measured yet: bench/fp8_device.py sweeps BLOCK_N/BLOCK_K/stages/warps and
# target_programs 1x-4x SMs at M=32 and 64 and prints the best per K class. target_programs is the grid cap
# (2 x SMs for the m<=16 entry gives the same splits on the 8B shapes as the old doubling rule at 1 x SMs).
FP8_LINEAR_M_CLASSES = ("m<=16", "m<=32", "m<=64")
_fp8_split = dict(target_programs=2 * SM_COUNT["sm90"], max_splits=16, min_split_k_tiles=4, PDL=0)
put("sm90", "fp8_linear", "*", "m<=16", max_m=16, fuse_quant=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256,
     num_warps=4, num_stages=4, **dict(_fp8_split, PDL=1))
put("sm90", "fp8_linear", "*", "m<=32", max_m=32, BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=8,
     num_stages=4, **_fp8_split)
put("sm90", "fp8_linear", "*", "m<=64", max_m=64, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8,
     num_stages=4, **_fp8_split)
put("sm90", "fp8_linear", "*", "m<=128", max_m=128, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8,
     num_stages=4, **_fp8_split)
put("sm90", "fp8_linear", "*", "m<=256", max_m=256, BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, num_warps=8,
     num_stages=3, **_fp8_split)

# Per input width K of the Llama-3-8B shape, the best of the H200 sweep at M=32 and 64 (bench/fp8_device.py,
# 2026-11-30, bench/results/h200_fp8_kernels_v3.txt; the lookup takes an exact variant before '*'): the
# table above gave qkv+o+gate_up 69.7 us and down 28.6 us at M=64; these 57.3 and 21.0 us. Other widths
# keep the '*' entries (not measured).
_fp8_per_k = dict(target_programs=1 * SM_COUNT["sm90"], max_splits=16, min_split_k_tiles=4, PDL=0)
for _k, _m, _block_k, _warps, _stages in ((4096, 32, 256, 4, 4), (14336, 32, 256, 8, 5), (4096, 64, 128, 8, 6),
                                         (14336, 64, 256, 4, 6)):   # BLOCK_M = max_m, BLOCK_N 64
    put("sm90", "fp8_linear", f"k{_k}_m{_m}", f"m<={_m}", max_m=_m, BLOCK_M=_m, BLOCK_N=64, BLOCK_K=_block_k,
        num_warps=_warps, num_stages=_stages, **_fp8_per_k)
