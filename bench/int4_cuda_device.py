"""Check and time the CUDA C++ W4A16 GEMV (templates/int4_gemv.cu.j2) on an H200 against bf16 F.linear and the
Triton int4 GEMV (kernels/int4_linear/triton.py).

  python bench/int4_cuda_device.py prepare .aot_int4_cuda   # here, CPU only: nvcc sm90 cubins for a sweep of
                                                            # template configs (g128; g64 for the edge checks)
                                                            # and the Triton int4 kernels as tuned
  python bench/int4_cuda_device.py run .aot_int4_cuda       # on the GPU box: cubins through the driver API

First correctness: every config on odd shapes (N not a multiple of the tile, K not of 128 nor of the group,
bias, M = 3, group 64: the per-weight scaling path) and on each 8B shape at every M, against the torch
reference (dequantize, matmul in float64; rel err < 1e-2, split counters back to zero), again after the
graph replays. Then timings: Llama-3-8B projections (qkv, o, gate_up, down; group 128) at M = 1, 2, 4, 8,
each a CUDA graph cycling through enough weight copies to miss L2; TB/s counts packed weights + scales +
zeros. Each CUDA config runs at 2x, 4x and 8x SMs of target_programs (a launch constant). The prefill
dequant (templates/int4_dequant.cu.j2, a few configs, and the Triton one) must equal the reference bit for bit
and is timed per shape (TB/s of bf16 written). The table (last) gives bf16, Triton int4 and the chosen CUDA
config per case, the 8B's GEMV time per decode step (32 layers) at each M, the dequant, and the tune table
entry. results.json and log.txt go under $OUT. INT4_CUDA_SHAPES (run) picks shapes: the 8B's int4 lm_head and
the one- and two-wave gate_up shapes are there besides the four projections.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

GROUP = 128
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
# INT4_CUDA_SHAPES=head (run): only those shapes, 'head' being the 8B's int4 lm_head [128256, 4096] (one a
# step, not one a layer: the per-step sums below then read as 32 heads)
# 'wave1' / 'wave2': gate_up's K with N for exactly one / two waves of the table's 32-row CTAs at 4 an SM (528
# slots): against gate_up's 896 CTAs (1.7 waves), what the last partial wave costs (nothing a byte:
# bench/results/h200_096a359_int4_waves.txt)
# 'mlp_1launch' / 'layer_1launch': as many W bytes as a layer's gate_up + down (88 MB) / qkv + o + gate_up + down
# (109 MB), in one K-4096 launch: what one stream of them would cost against the launches' sum (the bound of a
# persistent dataflow kernel that runs the layer's GEMVs back to back, before its dependency waits)
ALL_SHAPES = dict(SHAPES, head=(128256, 4096), wave1=(16896, 4096), wave2=(33792, 4096),
                  mlp_1launch=(28672 + 14336, 4096), layer_1launch=(6144 + 4096 + 28672 + 14336, 4096))
if os.environ.get("INT4_CUDA_SHAPES"):
    SHAPES = {name: ALL_SHAPES[name] for name in os.environ["INT4_CUDA_SHAPES"].split(",")}
MS = (1, 2, 4, 8)
WIDE_MS = (16, 32)        # the 'gemv_wide' builds (several n8 tiles of x) against dequant + cuBLAS and bf16
if os.environ.get("INT4_CUDA_MS"):   # run: only these M (no wide ones), e.g. 1 for a quick M=1 question
    MS, WIDE_MS = tuple(int(m) for m in os.environ["INT4_CUDA_MS"].split(",")), ()
SMS = 132
TARGETS = (2, 4, 8)       # target_programs = this x SMs
LAYERS = 32
# config name -> template constants (w warps, t 16-row tiles, u 128-wide K steps per iteration, b CTAs per SM;
# z: ZERO_SUM, the zero taken off each step's sum; s: ACC_SPLIT accumulators a step sum, 1 where not named).
# 59ba135's sweep also had PREFETCH and a tiled W layout with packed scale|zero words
# (bench/results/h200_59ba135_int4_variants.txt).
# the packed build family of the later sweeps: 4 warps, ZERO_SUM, two accumulators a step sum, PACKED_SZ
PACKED_S2 = dict(num_warps=4, ZERO_SUM=True, ACC_SPLIT=2, PACKED_SZ=True)
SWEEP = {"w4t2u1b4z": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True),
         "w4t2u1b4": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=False),
         "w4t1u2b4z": dict(num_warps=4, TILES=1, UNROLL=2, min_blocks=4, ZERO_SUM=True),
         "w4t1u4b3z": dict(num_warps=4, TILES=1, UNROLL=4, min_blocks=3, ZERO_SUM=True),
         "w4t4u1b3z": dict(num_warps=4, TILES=4, UNROLL=1, min_blocks=3, ZERO_SUM=True),
         # occupancy: ncu (bench/int4_gemv_ncu.py) found the table's config latency-bound, half its warps'
         # stall samples waiting on the W loads, 4 warps a scheduler (110 registers: 4 CTAs an SM); more
         # CTAs an SM cap the registers (b5: 102, b6: 85, b8: 64) and keep more loads in flight
         "w4t2u1b5z": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=5, ZERO_SUM=True),
         "w4t2u1b6z": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=6, ZERO_SUM=True),
         "w4t1u2b6z": dict(num_warps=4, TILES=1, UNROLL=2, min_blocks=6, ZERO_SUM=True),
         "w4t1u1b6z": dict(num_warps=4, TILES=1, UNROLL=1, min_blocks=6, ZERO_SUM=True),
         "w4t1u1b8z": dict(num_warps=4, TILES=1, UNROLL=1, min_blocks=8, ZERO_SUM=True),
         "w8t1u1b4z": dict(num_warps=8, TILES=1, UNROLL=1, min_blocks=4, ZERO_SUM=True),
         "w8t2u1b3z": dict(num_warps=8, TILES=2, UNROLL=1, min_blocks=3, ZERO_SUM=True),
         # ... or more W bytes in flight a warp (two K steps or four tiles an iteration), fewer CTAs
         "w4t2u2b3z": dict(num_warps=4, TILES=2, UNROLL=2, min_blocks=3, ZERO_SUM=True),
         "w4t2u2b2z": dict(num_warps=4, TILES=2, UNROLL=2, min_blocks=2, ZERO_SUM=True),
         "w4t4u1b2z": dict(num_warps=4, TILES=4, UNROLL=1, min_blocks=2, ZERO_SUM=True),
         "w8t2u2b2z": dict(num_warps=8, TILES=2, UNROLL=2, min_blocks=2, ZERO_SUM=True),
         "w4t1u4b4z": dict(num_warps=4, TILES=1, UNROLL=4, min_blocks=4, ZERO_SUM=True),
         # ABLATE (a measurement, not a kernel): the compute replaced by an XOR of the W words, so only the
         # W loads remain (the compiler drops the scale, zero and x loads): the loop's memory ceiling
         "w4t2u1b4z_a": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True, ABLATE=True),
         # ... at the table config's occupancy: the ablated build has few registers (8 CTAs an SM, ncu's 50%
         # theoretical occupancy against the full kernel's 25%), so PAD bytes of static shared memory cap it at
         # 4 or 6 CTAs an SM (48 or 36 KB with the warp sums): is the full kernel's gap to its loads the math or
         # the occupancy?
         "w4t2u1b4z_a4": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True, ABLATE=True,
                              PAD=49152 - 4224 - 16),
         "w4t2u1b4z_a6": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True, ABLATE=True,
                              PAD=36864 - 4224),
         # _a4all: as _a4 with the scale, zero and x loads folded in too (ABLATE drops them as dead): the loop's
         # loads, all of them, at the full kernel's occupancy
         "w4t2u1b4z_a4all": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True, ABLATE=True,
                                 PAD=49152 - 4224 - 16, ALL_LOADS=True),
         # ... and the W loads alone at 8 and 4 K steps an iteration (16 loads a lane in flight): the twenty-fifth
         # session's u8 / t2u4 builds were slower than u1 on gate_up, down and the head; do their loads alone slow
         # down too (the memory side) or not (the math's interplay with the loads)?
         "w4t1u8b3z_s2_k_a": dict(PACKED_S2, TILES=1, UNROLL=8, min_blocks=3, ABLATE=True),
         "w4t2u4b3z_s2_k_a": dict(PACKED_S2, TILES=2, UNROLL=4, min_blocks=3, ABLATE=True),
         "w4t2u1b4z_s2_k_a": dict(PACKED_S2, TILES=2, UNROLL=1, min_blocks=4, ABLATE=True),
         # TILED (a measurement: no checks, the results are wrong): W read as if laid out so that a CTA's K tile is one
         # contiguous run (K step by K step, each ROWS x 64 bytes, every warp load 512 contiguous bytes) instead of the
         # N-major layout's 64-byte row pieces K / 2 bytes apart; only the load addresses change. Are the GEMV's loads
         # (alone: _aT; in the full loop: _T) limited by that pattern, at 1 and at 8 K steps a warp in flight?
         "w4t2u1b4z_s2_k_aT": dict(PACKED_S2, TILES=2, UNROLL=1, min_blocks=4, ABLATE=True, TILED=True),
         "w4t1u8b3z_s2_k_aT": dict(PACKED_S2, TILES=1, UNROLL=8, min_blocks=3, ABLATE=True, TILED=True),
         "w4t2u4b3z_s2_k_aT": dict(PACKED_S2, TILES=2, UNROLL=4, min_blocks=3, ABLATE=True, TILED=True),
         "w4t2u1b4z_s2_k_T": dict(PACKED_S2, TILES=2, UNROLL=1, min_blocks=4, TILED=True),
         "w4t1u2b4z_k_T": dict(PACKED_S2, TILES=1, UNROLL=2, min_blocks=4, TILED=True, ACC_SPLIT=1),
         "w4t1u4b4z_s2_k_T": dict(PACKED_S2, TILES=1, UNROLL=4, min_blocks=4, TILED=True),
         "w4t1u8b3z_s2_k_T": dict(PACKED_S2, TILES=1, UNROLL=8, min_blocks=3, TILED=True),
         "w4t2u4b3z_s2_k_T": dict(PACKED_S2, TILES=2, UNROLL=4, min_blocks=3, TILED=True),
         # NO_XSUM / NO_XPERM (measurements: no checks, the results are wrong): the table's build without ZERO_SUM's per-step
         # x sums (8 mmas a warp and K step, a third of its mmas at TILES 2; they depend on x alone, so a producer could hand
         # them over) and / or without the byte permutes that regroup x to the W pairs' order (16 a lane and step; x could
         # arrive in that order): what the loop's x-only work costs, the part no W layout can remove
         "w4t2u1b4z_s2_k_nxs": dict(PACKED_S2, TILES=2, UNROLL=1, min_blocks=4, NO_XSUM=True),
         "w4t2u1b4z_s2_k_nxp": dict(PACKED_S2, TILES=2, UNROLL=1, min_blocks=4, NO_XPERM=True),
         "w4t2u1b4z_s2_k_nx": dict(PACKED_S2, TILES=2, UNROLL=1, min_blocks=4, NO_XSUM=True, NO_XPERM=True),
         # MAXNREG (a real, checked build; the tune entry's key since the twenty-sixth session): the table's loop held to
         # that many registers (__maxnreg__ in place of the launch bounds' CTA count). The NO_X builds above gained only
         # where both were off (h200_7f4c310_int4_xwork_*): at 96 registers, where ncu shows 5 CTAs an SM (Block Limit
         # Registers 5, achieved occupancy 29.5% against 23.8% on the head) instead of 4. min_blocks 5 never got there: ptxas
         # took 102 registers, which the 8-register allocation unit rounds to 104, four CTAs' worth. Does the real loop gain
         # as much at 96 (no spills; 88 spills 8 bytes)?
         "w4t2u1b4z_s2_k_r96": dict(PACKED_S2, TILES=2, UNROLL=1, min_blocks=4, MAXNREG=96),
         "w4t2u1b4z_k_r96": dict(PACKED_S2, TILES=2, UNROLL=1, min_blocks=4, MAXNREG=96, ACC_SPLIT=1),
         "w4t2u1b4z_s2_k_r88": dict(PACKED_S2, TILES=2, UNROLL=1, min_blocks=4, MAXNREG=88),
         # NO_MMA (with ABLATE's no-checks treatment, but the whole loop kept): each mma replaced by an integer
         # fold of its operands into the accumulator, so the dequant and every load stay and no tensor-core op
         # runs: the full kernel's SMs clock at ~1.78 GHz under ncu where the ablated build's hold 1.97
         "w4t2u1b4z_s2_nomma": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=2,
                                    ABLATE=True, NO_MMA=True),
         # a step's mmas over 2 or 4 accumulators (ACC_SPLIT; the table's gemv entry takes 2 since the twelfth
         # session), for the table's tile and the qkv build's
         "w4t2u1b4z_s2": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=2),
         # PACKED_SZ (_k): a tile's scales and zeros as one 8-byte word a row pair (kernels/int4_linear
         # pack_scales_zeros), one load a tile and K step where the [N, groups] arrays take four: the table's
         # config (on there since the twenty-fourth session) and the qkv build's (off there)
         "w4t2u1b4z_s2_k": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=2,
                                PACKED_SZ=True),
         "w4t1u2b4z_k": dict(num_warps=4, TILES=1, UNROLL=2, min_blocks=4, ZERO_SUM=True, PACKED_SZ=True),
         # ... and o's build (the table's gemv_n4096_k4096: EARLY_W, its first tile's packed words before the PDL wait)
         "w4t2u1b4z_s2_ke": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=2,
                                 PACKED_SZ=True, EARLY_W=True),
         # STAGGER (a measurement build): each warp sleeps STAGGER ns (a C expression of warp and blockIdx) before its
         # first load, so the warps of an SM do not all load, then all compute, in step: is the GEMV's slow marginal
         # rate (2.77 TB/s over one and two waves, 3.2 over the head's 7.6) its warps' phases in lockstep?
         "w4t2u1b4z_s2_k_st300": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=2,
                                      PACKED_SZ=True, STAGGER="warp * 300"),
         "w4t2u1b4z_s2_k_stc": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=2,
                                    PACKED_SZ=True, STAGGER="((blockIdx.x & 3) * 4 + warp) * 80"),
         "w4t2u1b4z_s4": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=4),
         # DEFER (a launch mode, not a kernel): the table's config timed with its split-K partials left
         # unreduced (no counter: each split stores its partial and exits; an AddRMSNorm sums them), against
         # w4t2u1b4z_s2 itself: what the in-launch reduce (fence, ticket, the last split's re-read) costs
         "w4t2u1b4z_s2_d": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=2,
                                DEFER=True),
         "w4t1u2b4z_s2": dict(num_warps=4, TILES=1, UNROLL=2, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=2),
         # ... and the occupancy / bytes-in-flight configs above again with two accumulators
         "w4t2u1b5z_s2": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=5, ZERO_SUM=True, ACC_SPLIT=2),
         "w4t2u1b6z_s2": dict(num_warps=4, TILES=2, UNROLL=1, min_blocks=6, ZERO_SUM=True, ACC_SPLIT=2),
         "w4t1u1b6z_s2": dict(num_warps=4, TILES=1, UNROLL=1, min_blocks=6, ZERO_SUM=True, ACC_SPLIT=2),
         "w4t1u1b8z_s2": dict(num_warps=4, TILES=1, UNROLL=1, min_blocks=8, ZERO_SUM=True, ACC_SPLIT=2),
         "w8t2u1b3z_s2": dict(num_warps=8, TILES=2, UNROLL=1, min_blocks=3, ZERO_SUM=True, ACC_SPLIT=2),
         "w4t2u2b3z_s2": dict(num_warps=4, TILES=2, UNROLL=2, min_blocks=3, ZERO_SUM=True, ACC_SPLIT=2),
         "w4t4u1b3z_s2": dict(num_warps=4, TILES=4, UNROLL=1, min_blocks=3, ZERO_SUM=True, ACC_SPLIT=2),
         # 16 W loads a lane in flight an iteration, as the bf16 CUDA GEMV's w4t1u8b3 keeps (3.2-4.3 TB/s on the 8B
         # shapes, h200_gemv_cuda_sweep.txt): the int4 sweeps above stopped at 8; qkv and o then take one or two
         # K iterations a CTA, i.e. one or two round trips a warp instead of four
         "w4t1u8b3z_s2_k": dict(num_warps=4, TILES=1, UNROLL=8, min_blocks=3, ZERO_SUM=True, ACC_SPLIT=2,
                                PACKED_SZ=True),
         "w4t1u8b2z_s2_k": dict(num_warps=4, TILES=1, UNROLL=8, min_blocks=2, ZERO_SUM=True, ACC_SPLIT=2,
                                PACKED_SZ=True),
         "w4t2u4b3z_s2_k": dict(num_warps=4, TILES=2, UNROLL=4, min_blocks=3, ZERO_SUM=True, ACC_SPLIT=2,
                                PACKED_SZ=True),
         "w4t2u4b2z_s2_k": dict(num_warps=4, TILES=2, UNROLL=4, min_blocks=2, ZERO_SUM=True, ACC_SPLIT=2,
                                PACKED_SZ=True),
         "w4t1u4b4z_s2_k": dict(num_warps=4, TILES=1, UNROLL=4, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=2,
                                PACKED_SZ=True),
         # the tune table's 'gemv_wide{16,32}' entries: max_m / 8 n8 tiles of x on each dequantized W fragment
         "wide_m32_w4t2u1b2": dict(kind="gemv_wide32", max_m=32, num_warps=4, TILES=2, UNROLL=1, min_blocks=2),
         "wide_m32_w4t1u2b2": dict(kind="gemv_wide32", max_m=32, num_warps=4, TILES=1, UNROLL=2, min_blocks=2),
         "wide_m32_w4t1u1b3": dict(kind="gemv_wide32", max_m=32, num_warps=4, TILES=1, UNROLL=1, min_blocks=3),
         "wide_m16_w4t2u1b3": dict(kind="gemv_wide16", max_m=16, num_warps=4, TILES=2, UNROLL=1, min_blocks=3),
         "wide_m16_w4t1u2b3": dict(kind="gemv_wide16", max_m=16, num_warps=4, TILES=1, UNROLL=2, min_blocks=3)}
ABLATE_AT = "        for (int u = 0; u < UNROLL; ++u) {        // ... then dequantize and multiply\n"
XSUM_AT = "                if (ZERO_SUM) {\n"
XPERM_AT = "xp[j][i][s] = __byte_perm(xr[e / 2], xr[e / 2 + 8], (i & 1) ? 0x7632 : 0x5410);"
TILED_AT = "load_w(w_row[t][h] + k / 8)"
TILED_LOAD = ("load_w(qweight + (int64_t)blockIdx.x * ROWS * (K / 8) + (int64_t)(k / STEP) * (ROWS * 16)"
              " + ((t * 2 + h) * 32 + lane) * 4)")
STAGGER_AT = "    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n"
PAD_AT = "    __shared__ float warp_sums[NUM_WARPS][MAX_M][ROWS + 1];"
PAD_BODY = """
    volatile __shared__ float occupancy_pad[{words}];   // PAD: caps CTAs an SM (volatile: M < 0 never holds)
    if (M < 0) occupancy_pad[threadIdx.x] = acc[0][0][0];
"""
MMA_AT = """    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{ %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
"""
MMA_FOLD = "    d[0] += __uint_as_float((a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1) & 0x007fffffu);\n"
ABLATE_BODY = """            uint32_t v = 0;   // inside the loop over u: a fold of this step's W words
#pragma unroll
            for (int t = 0; t < TILES; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h) v ^= wv[u][t][h].x ^ wv[u][t][h].y ^ wv[u][t][h].z ^ wv[u][t][h].w;
            acc[0][0][0] += __uint_as_float(v & 0x007fffffu);
            continue;
"""
# ALL_LOADS: ABLATE's body with the step's scales, zeros and x words folded in as well
ALL_LOADS_BODY = ABLATE_BODY.replace("            acc[0][0][0] +=", """#pragma unroll
            for (int t = 0; t < TILES; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h) v ^= bits(sv[u][t][h]) ^ zv[u][t][h];
#pragma unroll
            for (int j = 0; j < X_TILES; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) v ^= xv[u][j][q].x ^ xv[u][j][q].y ^ xv[u][j][q].z ^ xv[u][j][q].w;
            acc[0][0][0] +=""")


# a SWEEP entry's keys that steer this script (the build's patches, the launch mode), not the tune entry
BENCH_KEYS = ("ABLATE", "kind", "DEFER", "PAD", "NO_MMA", "ALL_LOADS", "STAGGER", "TILED", "NO_XSUM", "NO_XPERM")


def unchecked(set_name: str) -> bool:
    """Builds whose results are not the GEMV's (ABLATE, TILED, NO_XSUM, NO_XPERM): timed, never checked."""
    cfg = sweep_config(set_name)
    return any(cfg.get(key) for key in ("ABLATE", "TILED", "NO_XSUM", "NO_XPERM"))


def sweep_config(set_name: str) -> dict:
    """The SWEEP entry of a result's set ('cuda/<name>'); {} for the others (bf16, triton, dequant sets)."""
    return SWEEP.get(set_name[5:], {}) if set_name.startswith("cuda/") else {}


# the prefill dequant (templates/int4_dequant.cu.j2): w warps, c 16-byte chunks per thread
DEQUANT_SWEEP = {"w8c4": dict(num_warps=8, CHUNKS=4), "w8c2": dict(num_warps=8, CHUNKS=2),
                 "w4c8": dict(num_warps=4, CHUNKS=8), "w8c8": dict(num_warps=8, CHUNKS=8)}
EDGE = [(3, 1000, 1056, True), (8, 48, 4096 + 32, False), (1, 257, 2080, True),   # (M, N, K, bias)
        (20, 1000, 1056, True), (32, 48, 4096 + 32, False)]                     # the wide builds' rows


# ------------------------------------------------------------------------------------------ prepare (CPU)

def prepare(out_dir: Path):
    from engc.compiler.codegen import cuda, cuda_int4
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import int4_linear_specs
    if cuda.nvcc_path() is None:
        raise SystemExit("nvcc not found: the CUDA int4 GEMV cannot be built here")
    t0, index, sets = time.time(), {}, {}
    render = cuda.render
    # INT4_CUDA_SWEEP=name,... builds those configs alone (no dequant sweep, no Triton set): for
    # bench/int4_gemv_ncu.py, which runs nothing else
    only = [n for n in os.environ.get("INT4_CUDA_SWEEP", "").split(",") if n]
    for name, ov in SWEEP.items():
        if only and name not in only:
            continue
        ablate, kind, pad = ov.get("ABLATE", False), ov.get("kind", "gemv"), ov.get("PAD", 0)
        no_mma, body = ov.get("NO_MMA", False), ALL_LOADS_BODY if ov.get("ALL_LOADS") else ABLATE_BODY
        # one accumulator and the layout's scale / zero arrays unless the config says otherwise (the table's gemv
        # entry has 2 and PACKED_SZ)
        ov = {"ACC_SPLIT": 1, "PACKED_SZ": False, **{k: v for k, v in ov.items() if k not in BENCH_KEYS}}
        specs = [cuda_int4.int4_gemv_spec(GROUP, "bf16", "sm90", ov, kind)[0]]
        if name == next(iter(SWEEP)) or kind.startswith("gemv_wide") or ov["PACKED_SZ"]:   # + group 64's checks
            specs.append(cuda_int4.int4_gemv_spec(64, "bf16", "sm90", ov, kind)[0])
        stagger, tiled = SWEEP[name].get("STAGGER"), SWEEP[name].get("TILED")
        no_xsum, no_xperm = SWEEP[name].get("NO_XSUM"), SWEEP[name].get("NO_XPERM")
        if ablate or stagger or tiled or no_xsum or no_xperm:
            def patched(*a, **kw):
                src = render(*a, **kw)
                assert ABLATE_AT in src and PAD_AT in src and MMA_AT in src and STAGGER_AT in src
                if no_xsum:
                    assert src.count(XSUM_AT) == 1
                    src = src.replace(XSUM_AT, "                if (false) {\n")
                if no_xperm:
                    assert src.count(XPERM_AT) == 1
                    src = src.replace(XPERM_AT, "xp[j][i][s] = xr[e / 2 + 8 * (i & 1)];")
                if tiled:
                    assert TILED_AT in src
                    src = src.replace(TILED_AT, TILED_LOAD)
                if stagger:
                    src = src.replace(STAGGER_AT, STAGGER_AT + f"    __nanosleep({stagger});\n")
                if not ablate:
                    return src
                src = src.replace(MMA_AT, MMA_FOLD) if no_mma else src.replace(ABLATE_AT, ABLATE_AT + body)
                return src.replace(PAD_AT, PAD_AT + PAD_BODY.format(words=pad // 4)) if pad else src
            cuda.render = patched
        try:
            sets[f"cuda/{name}"] = cuda.compile_cuda(specs)
        finally:
            cuda.render = render
        print(f"cuda/{name}: {len(specs)} kernels ({time.time() - t0:.0f}s)", flush=True)
    for name, ov in ({} if only else DEQUANT_SWEEP).items():
        specs = [cuda_int4.int4_dequant_spec(g, "bf16", "sm90", ov)[0] for g in (GROUP, 64)]
        sets[f"cuda_dq/{name}"] = cuda.compile_cuda(specs)
        print(f"cuda_dq/{name}: {len(specs)} kernels ({time.time() - t0:.0f}s)", flush=True)
    if not only:
        sets["triton"] = compile_specs(int4_linear_specs("bf16", "sm90", (GROUP, 64)), jobs=2)
        print(f"triton: ({time.time() - t0:.0f}s)", flush=True)
    for set_name, res in sets.items():
        for path, data in res.files.items():
            dst = out_dir / set_name / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
        index[set_name] = res.records
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))


# ------------------------------------------------------------------------------------------ run (GPU)

def make_weights(n, k, group, copies, gen):
    import torch
    g = -(-k // group)
    out = []
    for _ in range(copies):
        qw = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda", generator=gen)
        s = (torch.rand(n, g, device="cuda", generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
        z = torch.randint(0, 16, (n, g), dtype=torch.uint8, device="cuda", generator=gen)
        out.append((qw, s, z))
    return out


def run(aot: Path, out: Path):
    import torch
    import torch.nn.functional as F
    from kernels_device import RunLog, load_sets, rel_err, time_graph
    from engc.kernels import gemv
    from engc.kernels import int4_linear as op
    run_log = RunLog()
    say = run_log.say
    sets = load_sets(aot)
    counters = torch.zeros(gemv.NUM_COUNTERS, dtype=torch.int32, device="cuda")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": [], "timings": []}
    packed = op.PackedScales()   # the packed_sz builds' scale / zero words, made once a weight as the runtime does

    def cuda_linear(name, target, x, w, group, bias=None, timed=False):
        ks = sets[name]
        consts = {v: dict(c, target_programs=target) if target else c for v, c in ks.consts("int4_linear").items()}
        y = torch.empty(x.shape[0], w[0].shape[0], dtype=x.dtype, device="cuda")
        m, (n, k) = x.shape[0], (w[0].shape[0], x.shape[1])
        splits = op.cuda_splits(m, n, k, group, consts, counters)
        partials = (torch.empty(splits, m, n, dtype=torch.float32, device="cuda")
                    if sweep_config(name).get("DEFER") and splits > 1 and bias is None else None)
        ks.run("int4_linear", op.cuda_launch(x, *w, bias, y, group_size=group, consts=consts, counters=counters,
                                             partials=partials, packed=packed))
        return y if partials is None or timed else partials.sum(0).to(x.dtype)   # timed: the launch alone

    def triton_linear(x, w, group, bias=None):
        ks = sets["triton"]
        return op.run_quantized_linear(x, *w, bias, group_size=group, consts=ks.consts("int4_linear"),
                                       run=lambda launches: ks.run("int4_linear", launches))

    def check(tag, got, ref):
        err = rel_err(got, ref)
        ok = err < 1e-2 and int(counters.abs().sum().item()) == 0
        results["checks"].append(dict(tag, err=err, ok=ok))
        if not ok:
            say(f"CHECK FAILED {tag}: rel err {err:.2e}, counters {int(counters.abs().sum().item())}")
        return ok

    def dequant(name, w, group, n, k):
        out = torch.zeros(n, k, dtype=torch.bfloat16, device="cuda")
        sets[name].run("int4_linear", op.dequant_launch(*w, out, group_size=group,
                                                        consts=sets[name].consts("int4_linear")))
        return out

    def exact(tag, got, w, group):
        ok = torch.equal(got, op.dequantize(*w, group))
        results["checks"].append(dict(tag, ok=ok))
        if not ok:
            say(f"CHECK FAILED {tag}: the dequant differs from the reference")
        return ok

    gen = torch.Generator(device="cuda").manual_seed(0)
    cuda_sets = [name for name in sets if name.startswith("cuda/")]
    dq_sets = [name for name in sets if name.startswith("cuda_dq/")]
    # 1. odd shapes: tails along N and K, a short last group, bias, group 64 (scaled per weight)
    for group in (GROUP, 64):
        for m, n, k, with_bias in EDGE:
            w = make_weights(n, k, group, 1, gen)[0]
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
            b = torch.randn(n, dtype=torch.bfloat16, device="cuda", generator=gen) if with_bias else None
            ref = x.double() @ op.dequantize(*w, group).double().t() + (b.double() if with_bias else 0)
            for name in cuda_sets:
                if unchecked(name):
                    continue
                if op.cuda_variant_for(m, group, sets[name].consts("int4_linear")):   # one launch holds M
                    for target in (None, 8 * SMS):
                        check(dict(case="edge", group=group, M=m, N=n, K=k, bias=with_bias, set=name, target=target),
                              cuda_linear(name, target, x, w, group, b), ref)
            if "triton" in sets:
                check(dict(case="edge", group=group, M=m, N=n, K=k, bias=with_bias, set="triton"),
                      triton_linear(x, w, group, b), ref)
            for name in dq_sets:
                exact(dict(case="edge", group=group, N=n, K=k, set=name), dequant(name, w, group, n, k), w, group)
    say(f"edge checks: {sum(c['ok'] for c in results['checks'])}/{len(results['checks'])} ok "
        f"({run_log.elapsed():.0f}s)")
    # 2. the 8B shapes: check, time, check again after the graph replays
    for shape, (n, k) in SHAPES.items():
        wbytes = n * k // 2 + 3 * n * (k // GROUP)
        copies = max(2, math.ceil(150e6 / wbytes))
        ws = make_weights(n, k, GROUP, copies, gen)
        dense = [op.dequantize(*ws[i], GROUP) for i in range(max(2, math.ceil(150e6 / (2 * n * k))))]
        ref_w = dense[0].double()
        scratch = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")   # the prefill path: dequant, cuBLAS
        for name in [n for n in ("triton", *dq_sets) if n in sets]:
            consts = sets[name].consts("int4_linear")
            plans = [op.dequant_launch(*ws[i], scratch, group_size=GROUP, consts=consts) for i in range(copies)]
            if exact(dict(shape=shape, set=name, case="dequant"), dequant(name, ws[0], GROUP, n, k), ws[0], GROUP):
                us = time_graph(lambda i: sets[name].run("int4_linear", plans[i]), copies)
                results["timings"].append(dict(shape=shape, N=n, K=k, M="dequant", set=name, us=us,
                                               write_tbs=2 * n * k / us / 1e6, tbs=(wbytes + 2 * n * k) / us / 1e6))
        scratch = None
        for m in MS + WIDE_MS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
            ref = x.double() @ ref_w.t()
            row = dict(shape=shape, N=n, K=k, M=m, wbytes=wbytes)
            bf16_us = time_graph(lambda i: F.linear(x, dense[i % len(dense)]), len(dense))
            results["timings"].append(dict(row, set="bf16", us=bf16_us, tbs=2 * n * k / bf16_us / 1e6))
            if "triton" in sets and check(dict(row, set="triton"), triton_linear(x, ws[0], GROUP), ref):
                us = time_graph(lambda i: triton_linear(x, ws[i], GROUP), copies)
                results["timings"].append(dict(row, set="triton", us=us, tbs=wbytes / us / 1e6))
            for name in cuda_sets:
                if not op.cuda_variant_for(m, GROUP, sets[name].consts("int4_linear")):
                    continue
                for mult in TARGETS:
                    target = mult * SMS
                    tag = dict(row, set=name, target=target)
                    ablate = unchecked(name)
                    if not ablate and not check(tag, cuda_linear(name, target, x, ws[0], GROUP), ref):
                        continue
                    us = time_graph(lambda i: cuda_linear(name, target, x, ws[i], GROUP, timed=True), copies)
                    if ablate or check(dict(tag, after="graph"), cuda_linear(name, target, x, ws[0], GROUP), ref):
                        results["timings"].append(dict(tag, us=us, tbs=wbytes / us / 1e6))
        say(f"{shape}: done ({run_log.elapsed():.0f}s)")
        ws = dense = None
        packed = op.PackedScales()   # let this shape's weights go
        torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table(results, say)
    run_log.finish(out)


def table(results, say):
    bad = [c for c in results["checks"] if not c["ok"]]
    all_ts = results["timings"]
    ablated = [t for t in all_ts if sweep_config(t["set"]).get("ABLATE")]
    wide = [t for t in all_ts if t["M"] in WIDE_MS]
    ts = [t for t in all_ts if t["M"] in MS and not unchecked(t["set"]) and not sweep_config(t["set"]).get("DEFER")
          and not sweep_config(t["set"]).get("kind", "").startswith("gemv_wide")]
    say("")
    say(f"== checks: {len(results['checks']) - len(bad)}/{len(results['checks'])} ok (rel err < 1e-2 vs the float64 "
        "reference, before and after graph replay, counters back to zero) ==")
    for c in bad[:10]:
        say(f"  FAILED {c}")
    totals = {}
    for t in ts:
        if t["set"].startswith("cuda/"):
            totals[(t["set"], t["target"])] = totals.get((t["set"], t["target"]), 0.0) + t["us"]
    totals = {key: v for key, v in totals.items()
              if sum(1 for t in ts if (t["set"], t.get("target")) == key) == len(SHAPES) * len(MS)}
    if not totals:
        say("no CUDA config passed every case")
        return
    (chosen, target), _ = min(totals.items(), key=lambda kv: kv[1])
    say(f"== us per launch (TB/s of packed weights + scales + zeros; bf16: of its weights); CUDA = {chosen} at "
        f"target_programs {target} ==")
    say(f"  {'shape':<8} {'M':>1} {'bf16':>14} {'triton int4':>14} {'CUDA int4':>14} {'x bf16':>6} {'x triton':>8}"
        f"  best CUDA (any config)")
    step = {m: {"bf16": 0.0, "triton": 0.0, "cuda": 0.0} for m in MS}
    for shape in SHAPES:
        for m in MS:
            mine = [t for t in ts if t["shape"] == shape and t["M"] == m]
            get = lambda s, tg=None: next((t for t in mine if t["set"] == s and t.get("target") == tg), None)  # noqa
            bf, tri, c = get("bf16"), get("triton"), get(chosen, target)
            best = min((t for t in mine if t["set"].startswith("cuda/")), key=lambda t: t["us"])
            fmt = lambda t: f"{t['us']:7.2f} ({t['tbs']:4.2f})" if t else f"{'-':>14}"  # noqa
            say(f"  {shape:<8} {m:>1} {fmt(bf)} {fmt(tri)} {fmt(c)} {bf['us'] / c['us']:6.2f} "
                f"{(tri['us'] / c['us']) if tri else float('nan'):8.2f}  {best['set'][5:]} t{best['target']} "
                f"{best['us']:.2f}")
            step[m]["bf16"] += LAYERS * bf["us"] / 1e3
            step[m]["triton"] += LAYERS * (tri["us"] if tri else math.nan) / 1e3
            step[m]["cuda"] += LAYERS * c["us"] / 1e3
    say(f"== the 8B's projection GEMVs per decode step ({LAYERS} layers, no lm_head), ms ==")
    for m in MS:
        say(f"  M={m}: bf16 {step[m]['bf16']:.3f}  triton int4 {step[m]['triton']:.3f}  CUDA int4 {step[m]['cuda']:.3f}")
    dq = [t for t in all_ts if t["M"] == "dequant"]
    if dq:
        say("== prefill dequant, us (TB/s written) ==")
        names = sorted({t["set"] for t in dq})
        say(f"  {'shape':<8} " + " ".join(f"{n.split('/')[-1]:>15}" for n in names))
        for shape in SHAPES:
            cells = [next((t for t in dq if t["shape"] == shape and t["set"] == n), None) for n in names]
            say(f"  {shape:<8} " + " ".join(f"{c['us']:7.1f} ({c['write_tbs']:4.2f})" if c else f"{'-':>15}"
                                          for c in cells))
        full = {n: sum(t["us"] for t in dq if t["set"] == n) for n in names
                if n != "triton" and sum(1 for t in dq if t["set"] == n) == len(SHAPES)}
        if full:
            best = min(full, key=full.get)
            say(f"  for the tune table (sm90/int4_linear/cuda/dequant): enabled=True, "
                f"{', '.join(f'{k}={v}' for k, v in DEQUANT_SWEEP[best.split('/')[-1]].items())}")
    if wide:
        say("== M 16/32: the wide CUDA GEMV (best config per case) against dequant + cuBLAS (today's path) and bf16, "
            "us ==")
        for shape in SHAPES:
            for m in WIDE_MS:
                mine = [t for t in wide if t["shape"] == shape and t["M"] == m]
                get = lambda s: next((t["us"] for t in mine if t["set"] == s), math.nan)  # noqa: E731
                cu = [t for t in mine if t["set"].startswith("cuda/")]
                best = min(cu, key=lambda t: t["us"]) if cu else None
                say(f"  {shape:<8} {m:>2}  bf16 {get('bf16'):7.2f}  dequant+cuBLAS {get('triton'):7.2f}  "
                    + (f"wide {best['us']:7.2f} ({best['set'][5:]} t{best['target']})" if best else "wide -"))
        for m in WIDE_MS:
            per = {}
            for t in wide:
                if t["M"] == m and t["set"].startswith("cuda/"):
                    per.setdefault((t["set"], t["target"]), []).append(t["us"])
            full = {key: sum(v) for key, v in per.items() if len(v) == len(SHAPES)}
            base = {s: sum(t["us"] for t in wide if t["M"] == m and t["set"] == s) for s in ("bf16", "triton")}
            if full:
                (name, target), us = min(full.items(), key=lambda kv: kv[1])
                say(f"  M={m} step ({LAYERS} layers), ms: bf16 {LAYERS * base['bf16'] / 1e3:.3f}  dequant+cuBLAS "
                    f"{LAYERS * base['triton'] / 1e3:.3f}  wide {LAYERS * us / 1e3:.3f} ({name[5:]} t{target})")
    deferred = [t for t in all_ts if sweep_config(t["set"]).get("DEFER") and t["M"] in MS]
    if deferred:
        say("== split-K partials left to the reader (DEFER) against the in-launch reduce, us ==")
        for t in deferred:
            base = next((b for b in all_ts if b["set"] == t["set"][:-2] and b["shape"] == t["shape"]
                         and b["M"] == t["M"] and b.get("target") == t.get("target")), None)
            if base:
                say(f"  {t['shape']:<8} M={t['M']} t{t['target']}: {t['us']:6.2f} against {base['us']:6.2f}")
    if ablated:
        say("== W loads alone (ABLATE: the loop's memory ceiling), M=1, us (TB/s) ==")
        for name in sorted({t["set"] for t in ablated}):
            cells = [min((t for t in ablated if t["set"] == name and t["shape"] == sh and t["M"] == 1),
                         key=lambda t: t["us"]) for sh in SHAPES]
            say(f"  {name[5:]:<16} " + " ".join(f"{sh} {c['us']:6.2f} ({c['tbs']:4.2f})" for sh, c in zip(SHAPES, cells)))
    say("== every build, M=1, best target, us (TB/s); _T / _aT: TILED, no checks ==")
    for name in sorted({t["set"] for t in all_ts if t["set"].startswith("cuda/") and t["M"] == 1}):
        cells = [min((t for t in all_ts if t["set"] == name and t["shape"] == sh and t["M"] == 1),
                     key=lambda t: t["us"], default=None) for sh in SHAPES]
        say(f"  {name[5:]:<20} " + " ".join(f"{sh} {c['us']:6.2f} ({c['tbs']:4.2f})" if c else f"{sh} -"
                                            for sh, c in zip(SHAPES, cells)))
    cfg = sweep_config(chosen)
    say(f"== for the tune table (sm90/int4_linear/cuda/gemv): enabled=True, max_m=8, "
        f"{', '.join(f'{k}={v}' for k, v in cfg.items())}, target_programs={target // SMS} * SM_COUNT[_arch] ==")


if __name__ == "__main__":
    from kernels_device import step_main
    step_main({"prepare": lambda aot, out: prepare(aot), "run": run})
