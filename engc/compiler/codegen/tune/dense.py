"""Tune entries of the dense bf16/fp16 decode projections: the Triton GEMV (per M class and per (K, N)
region at M=1), the CUDA C++ GEMV, and the skinny GEMM of 9-64 rows."""
from __future__ import annotations

from engc.compiler.codegen.tune.table import SM_COUNT, TUNE, put

# Decode GEMV (kernels/gemv), one entry per M class. Measured on the H200 (bench/gemv_device.py, cold L2,
# 2026-11-30): against cuBLAS it wins only at M=1, and only clearly for the SiLU-fused down projection
# (1B 11.9 vs 14.4 us, 8B 32.0 vs 32.7 us, plus the silu_mul launch it removes); at M=1 for K=hidden it
# wins on o and lm_head but loses more on gate_up (-2 us a layer), and from M=2 up cuBLAS wins everywhere.
# So: one class, M=1, SiLU-fused down only (plain=False keeps K=hidden projections on cuBLAS here; plain
# projections get the per-(K, N) entries of GEMV_PLAIN_CLASSES below).
GEMV_M_CLASSES = ("m<=1",)
for _arch in ("sm80", "sm90"):
    # Not kept: W loads before the PDL wait. The whole slice prefetched to L2 lost 12% (0262219); the first
    # W tile of each split (EARLY_W, ec9c5a4) lost 0.9% on 1B and 3.7% on 8B at batch 1 (bench/results/
    # h200_5b7e245_early_w_engc_1b.json, h200_02e91c9_early_w_engc_8b.json). A likely cause, not measured: the
    # early programs hold SM slots and registers while the kernel before them still runs.
    put(_arch, "gemv", "*", "m<=1", max_m=1, plain=False, BLOCK_M=4, BLOCK_N=8, BLOCK_K=1024, DOT=False,
         num_warps=4, num_stages=2, target_programs=2 * SM_COUNT[_arch], max_splits=16, min_split_k_tiles=2,
         silu_by_n=((1, 2048, {"BLOCK_N": 4}),))
    # silu_by_n: (N lo, N hi (0: no bound), overrides) for the SiLU-fused down by its N (the hidden size):
    # BLOCK_N 8 leaves an N of 2048 only 256 programs; the sweep's best for the 1B down (K 8192, N 2048)
    # was BLOCK_N 4 (11.9 us) where this entry's BLOCK_N 8 ran 14.0 us (bench/results, run-pick)
    # classes kept for sweeps and tests (bench/gemv_device.py, tests/test_gemv.py); cuBLAS was faster
    put(_arch, "gemv", "*", "m<=4", max_m=4, BLOCK_M=4, BLOCK_N=8, BLOCK_K=1024, DOT=False, num_warps=4,
         num_stages=2, target_programs=4 * SM_COUNT[_arch], max_splits=16, min_split_k_tiles=2)
    put(_arch, "gemv", "*", "m<=16", max_m=16, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, DOT=True, num_warps=4,
         num_stages=4, target_programs=4 * SM_COUNT[_arch], max_splits=16, min_split_k_tiles=2)

# Plain projections (Gemm x @ W^T, no bias) at M=1, one entry per tile config: `serves` lists the (K range,
# N range) regions, (lo, hi) inclusive, hi 0 = no bound, where that config ran ahead of or even with cuBLAS
# in the H200 sweep (bench/results/h200_gemv_sweep.txt, cold L2, us per launch; the m<=4 sweep kernels,
# BLOCK_M 4 like these, none split K). A projection outside every region stays with cuBLAS. The first entry
# of GEMV_PLAIN_CLASSES whose regions hold (K, N) serves it; the build compiles an entry for a K only when
# a projection of the model falls in it (decode_gemm_specs.gemv_specs), and the runtime picks by (K, N, M)
# from the N ranges recorded in the variant's launch constants (kernels/gemv.pick).
#   n8k512w2, K > 2048: 8B o (K 4096, N 4096) 12.10 vs 13.70 us (cuBLAS also adds a 1.6 us splitKreduce
#     launch), 8B qkv (N 6144) 15.80 vs 15.94; N <= 8192 covers both, not gate_up (8B N 28672: 59.98 vs
#     57.57 at the best config, n4k1024w4);
#   n8k512w2, any K, N >= 65536 (lm_head): 8B (K 4096) 245.6 vs 263.4 us, 1B (K 2048) 125.4 vs 131.9;
#   n4k1024w4, K <= 2048, N <= 2048: 1B o (N 2048) 5.31 vs 6.08 us; not 1B qkv (N 3072: 6.76 vs 6.52 at
#     its best) nor gate_up (N 16384: 20.78 vs 18.92);
#   n4k1024w4, K > 2048, 8192 < N < 65536: 8B gate_up (N 28672): alone 0.96x cuBLAS (59.98 vs 57.57 us),
#     but with PDL the whole 8B batch-1 step ran 4.300 ms against 4.334 with cuBLAS (231.9 vs 230.0 tok/s,
#     bench/results/h200_18fe01d_*): the down GEMV after it can then start early too.
# Other K and N inside these regions (3B, 70B, small models) are extrapolated, not measured.
GEMV_PLAIN_CLASSES = ("m<=1/n4k1024w4", "m<=1/n8k512w2")
for _arch in ("sm80", "sm90"):
    _plain_m1 = dict(max_m=1, BLOCK_M=4, DOT=False, num_stages=2, target_programs=2 * SM_COUNT[_arch],
                     max_splits=16, min_split_k_tiles=2)
    put(_arch, "gemv", "*", "m<=1/n4k1024w4", BLOCK_N=4, BLOCK_K=1024, num_warps=4,
         serves=(((1, 2048), (1, 2048)), ((2049, 0), (8193, 65535))), **_plain_m1)
    put(_arch, "gemv", "*", "m<=1/n8k512w2", BLOCK_N=8, BLOCK_K=512, num_warps=2,
         serves=(((2049, 0), (1, 8192)), ((1, 0), (65536, 0))), **_plain_m1)

# The CUDA C++ decode GEMV (templates/gemv.cu.j2: tensor-core mma, any M <= max_m <= 8 for the cost of
# one), per M class. Built, and preferred by the runtime to the Triton GEMV and cuBLAS, for the kinds the
# entry turns on -- plain: K = hidden / q_size (qkv, o; gate_up and lm_head too unless N > max_n, 0 = any);
# silu: the fused down -- and only where nvcc was there at build time. Tiles: num_warps warps share
# 16 * TILES rows of W, each reads UNROLL 32-wide K steps per iteration (BLOCK_K = 32 * warps * UNROLL);
# min_blocks: CTAs per SM the register budget allows (65536 / (32 * warps * min_blocks) registers each).
# Off (plain and silu False): bench/gemv_cuda_device.py found it even with the Triton GEMV per call at best; as
# a whole 8B b1 step (thirteenth session, with PDL, config w4t1u8b3) it ran 223.6 tok/s with one accumulator
# and 229.3 with ACC_SPLIT 2 against 239.3 for the Triton GEMV (bench/results/h200_38c6765_cuda_gemv_s*).
# Nor a class for 9-32 rows (968dbb5, reverted: max_m / 8 n8 tiles of x on every W fragment, in place of the
# skinny GEMM): at 16-32 rows it lost to cuBLAS on every 8B and 1B projection at its best config (8B qkv
# 16.5-18.0 us against 16.4-16.6, o 15.1-18.2 against 13.2-13.8, down with SiLU 75-111 against 33-34), and
# the 8B b32 step ran 5.68 ms a token against 4.80 (bench/results/h200_968dbb5_gemv_cuda_m32.json).
GEMV_CUDA_M_CLASSES = ("m<=8",)
for _arch in ("sm80", "sm90"):
    put(_arch, "gemv", "cuda", "m<=8", max_m=8, plain=False, silu=False, max_n=0, num_warps=4, TILES=2,
         UNROLL=4, min_blocks=4, ACC_SPLIT=1, target_programs=4 * SM_COUNT[_arch], max_splits=16,
         min_split_k_tiles=1)

# Skinny bf16/fp16 GEMM (kernels/skinny_gemm) for dense projections of decode batches, one entry per M class
# [min_m, max_m] (M=1 has the GEMV; 2-8 unmeasured, left to cuBLAS): built per K of the model's projections
# (plain, and the SiLU-fused down) only where `enabled`, then run before cuBLAS for N <= max_n (0: any).
# Starting points by the fp8_linear sweep's arithmetic (its winners at M=32/64 streamed 16 KB W tiles,
# BLOCK_N 64, over 4-6 stages, one program per SM, split-K filling one wave: target_programs 1 x SMs), the
# token side padded to the class; PREFETCH_K: W columns each program asks L2 for before its PDL wait.
# Off (enabled False): per GEMM it was even with cuBLAS at 16-32 rows (bench/skinny_gemm_device.py), and as
# a whole 8B step it lost: m<=16 and m<=32 on (bench/ab's skinny_32, one lease, 2026-12-01) gave b32
# 128/128 5,342 tok/s against 5,708-5,733 with cuBLAS (bench/results/h200_b1c505b_skinny32_engc_8b.json;
# again at f4538da: 5,410 against 5,855, h200_f4538da_skinny32_*), because these generic entries are not
# the sweep's winners per K (below).
# sm80 by analogy (fewer stages: 163 KB of shared memory).
SKINNY_GEMM_M_CLASSES = ("m<=16", "m<=32", "m<=64")
for _arch, _stages in (("sm80", 4), ("sm90", 6)):
    _skinny = dict(enabled=False, max_n=0, BLOCK_N=64, BLOCK_K=128, num_warps=4, PREFETCH_K=256,
                   target_programs=SM_COUNT[_arch], max_splits=16, min_split_k_tiles=4)
    put(_arch, "skinny_gemm", "*", "m<=16", min_m=9, max_m=16, BLOCK_M=16, num_stages=_stages, **_skinny)
    put(_arch, "skinny_gemm", "*", "m<=32", min_m=17, max_m=32, BLOCK_M=32, num_stages=_stages, **_skinny)
    put(_arch, "skinny_gemm", "*", "m<=64", min_m=33, max_m=64, BLOCK_M=64, num_stages=_stages - 1, **_skinny)
# ... and per-K entries for the 8B's widths at 17-32 rows, the sweep's winners per K (h200_b093c46_skinny_gemm.txt,
# 'best per (model, K, M class)'): K 4096 (qkv, o, gate_up, lm_head) 64 x 128 tiles over 4 stages (two programs
# an SM), the SiLU-fused down (K 14336) 128 x 128 tiles with 8 warps. The '*' entry (6 stages: one program an SM)
# took that down 59.5 us at 32 rows against 36.5 (cuBLAS and silu_mul: 36.6), ~0.7 ms a step, and that is what
# the step A/Bs above enabled. On since the eleventh session: in one lease (bench/results/h200_8ccda65_*)
# these two gave 8B b32 128/128 5,858 tok/s against 5,745 with cuBLAS (+2.0%; first runs 5,872 / 5,704), b1
# and b64 unchanged. Without PDL their GEMMs take 4.31 ms a step against cuBLAS's 4.19 (another lease): the
# gain is the PDL overlap with the kernels beside them (cuBLAS launches plainly), e.g. the attention's early
# KV loads behind qkv.
# The same widths' winners at 9-16 rows (same sweep: 3,008 against cuBLAS's 3,041 us a step for K 4096, 1,108
# against 1,133 for the SiLU down). On since the twelfth session: the step A/B in one lease (bench/ab's
# skinny_16_k, bench/results/h200_1ff3351_*) gave 8B b16 128/128 3,420 tok/s against 3,307 with cuBLAS (+3.4%;
# first runs 3,377 / 3,275), b32 and b1 unchanged (5,999 / 6,011, 240.9 / 241.2).
for _m in (16, 32):
    _generic = TUNE[f"sm90/skinny_gemm/*/m<={_m}"]
    put("sm90", "skinny_gemm", f"k4096_m{_m}", f"m<={_m}", **dict(_generic, num_stages=4, enabled=True))
    put("sm90", "skinny_gemm", f"silu_k14336_m{_m}", f"m<={_m}",
         **dict(_generic, BLOCK_N=128, num_warps=8, num_stages=4, enabled=True))

# Not here: a residual add + RMSNorm fused into these kernels' input tiles (kernels/norm_linear, 23d4a5c,
# reverted). In a swap-AB kernel every program reads and transforms all of x for its W rows, so the fusion
# multiplies the norm's work by the N tiles (and x and the residual took pipeline stages, halving programs an
# SM): on the H200 it took the 8B's qkv 23.8-40.3 us against 17.0-17.7 for add_rms_norm + this GEMM, gate_up
# 64-124 against 60-62, and b32 128/128 to 3,707-5,483 tok/s against 6,026
# (bench/results/h200_23d4a5c_norm_linear_*). The separate norm kernel normalizes x once.
