"""The per-arch tune table: block shapes, warps, pipeline depth and launch constants per kernel.

Keys are "arch/op/variant/bucket"; the bucket names the shape class the entry was chosen for. The chosen
key and entry go into every kernel record of the manifest. The sm90 decode and prefill entries and the
decode split rule were picked from sweeps on an H200 with bench/kernels_device.py (Llama-3-8B and
Llama-3.2-1B attention shapes, bf16): decode d=64 BLOCK_N 128 and d=128 BLOCK_N 64 were best or within
noise on most of B 1/32/64 x ctx 512/4096; prefill m64n64w4s3 (d=64) and m128n64w4s3 (d=128) were best on
2-3 of 3 shapes. sm80 entries are carried over by analogy (no A100 was measured).
"""
from __future__ import annotations

from contextlib import contextmanager

ARCHS = ("sm80", "sm90")
# Programmatic dependent launch of the kernels that support it (kernels/pdl.py): griddepcontrol is sm90+.
PDL = {"sm80": 0, "sm90": 1}
# Programs the split-KV decode aims to keep in flight: about 2 per multiprocessor.
_SM_COUNT = {"sm80": 108, "sm90": 132}


def sm_count(arch: str) -> int:
    """The multiprocessors of the GPU the table's split targets (target_programs) assume for arch: A100 108,
    H100/H200 132 (engc tune --prepare plans for it unless --sms says otherwise)."""
    return _SM_COUNT[arch]

TUNE: dict[str, dict] = {}


def _put(arch: str, op: str, variant: str, bucket: str, **entry):
    TUNE[f"{arch}/{op}/{variant}/{bucket}"] = entry


for _arch in ("sm80", "sm90"):
    for _bucket, _warps in (("block<=1024", 4), ("block<=4096", 8), ("block>4096", 16)):
        _put(_arch, "rms_norm", "*", _bucket, num_warps=_warps, num_stages=1)
        _put(_arch, "qk_norm", "*", _bucket, num_warps=_warps, num_stages=1)
        _put(_arch, "rotary", "*", _bucket, num_warps=_warps, num_stages=1)
    _put(_arch, "silu_mul", "*", "any", BLOCK=1024, num_warps=4, num_stages=1)
    _put(_arch, "sampling", "*", "any", BLOCK_V=4096, num_warps=8, num_stages=1)
    _put(_arch, "argmax", "*", "any", block=1024, max_splits=64, num_warps=4, num_stages=1)
    _split = dict(target_programs=2 * _SM_COUNT[_arch], max_splits=64, min_split_tokens=128,
                  min_split_tokens_busy=1024)
    # impl: which decode kernel the runtime launches, "triton" or "cuda" (the template below); Triton
    # until bench/kernels_device.py shows the template faster on that arch and head_dim class.
    # The Triton decode combines its splits in the same launch (in_kernel_reduce: the last split to arrive
    # reduces), so a split costs a partial write, not a launch: while (sequence, KV head) pairs leave the
    # GPU short of target_programs, split down to one BLOCK_N tile a program (min_split_tokens = BLOCK_N;
    # it was 128 tokens with the reduce launch). Busy batches (pairs fill half of target_programs: the rule then
    # picks 1 or 2 splits) split from two tiles of context: on the H200 two splits beat one at 8B batch 24 and
    # 32 at every context measured, 0.90x at 192 tokens to 0.64x at 2048 (bench/results/h200_4e0a94b_attn_busy.txt:
    # 'old' and 'split1' against 'base'). The 1024 tokens before came from BLOCK_N 64, where one split was
    # ahead (h200_cb40abc_attn_b1.txt, e1_split1), and kept eager and mixed steps under 2048 tokens on one
    # split, while decode graphs, sized for the block table's capacity, split anyway.
    # H200 (bench/results/h200_decode_fused.txt): the in-kernel reduce is even with the two-launch form or
    # ahead (8B b1 ctx 256: 10.8 vs 12.9 us with rotary).
    # rotary_max_rows: RotaryPagedAttention runs as one kernel (decode_rotary) on decode steps of at most
    # this many rows; above, rotary + decode. On the H200 the fused kernel was 0.58-0.81x the pair's time
    # at batch 1-4, 0.78-0.91x at batch 32 up to 1k context (1.08-1.17x at 4k), and 1.03-1.24x at 64.
    # EARLY_KV: decode_rotary's order of memory round trips (its docstring; 0 = load the KV tiles after the
    # rotary; 1/2 = issue the first tile's loads first / also before the PDL wait); bench/attn_b1_device.py.
    # H200 (bench/results/h200_cb40abc_attn_b1.txt, decode_rotary behind a PDL predecessor): BLOCK_N 32 with
    # EARLY_KV 2 takes 4.9-6.9 us a launch at 8B b1 ctx 128-256 against 6.3-8.6 for BLOCK_N 64 / EARLY_KV 0,
    # and 16.3 against 20.3 at b32 ctx 256; 1B (d 64) b1 ctx 256: EARLY_KV 2 7.1 against 7.4. sm80 has no PDL
    # and EARLY_KV 1 alone gained nothing there; d > 128 was not measured.
    _sm90 = _arch == "sm90"
    for _bucket, _block_n, _stages, _early in (("d<=64", 128, 2, 2 if _sm90 else 0),
                                               ("d<=128", 32 if _sm90 else 64, 3 if _sm90 else 2, 2 if _sm90 else 0),
                                               ("d>128", 32, 2, 0)):
        _put(_arch, "paged_attention", "decode", _bucket, BLOCK_N=_block_n, num_warps=4, num_stages=_stages,
             impl="triton", **dict(_split, min_split_tokens=_block_n, min_split_tokens_busy=2 * _block_n),
             in_kernel_reduce=True, rotary_max_rows=32,
             EARLY_KV=_early)
    # decode_reduce: the second launch of the CUDA decode template (the Triton decode reduces in-kernel)
    _put(_arch, "paged_attention", "decode_reduce", "any", num_warps=4, num_stages=1)
    # The CUDA C++ twin of the decode kernel (templates/paged_decode.cu.j2): built and launched instead of
    # the Triton one only where the 'decode' entry says impl="cuda" and nvcc was there at build time.
    # BLOCK_N follows from warps and tokens per thread (64 tokens for d<=128, 32 for d=256).
    _put(_arch, "paged_attention", "decode_cuda", "d<=64", TOKENS_PER_THREAD=4, num_warps=4, **_split)
    _put(_arch, "paged_attention", "decode_cuda", "d<=128", TOKENS_PER_THREAD=8, num_warps=4, **_split)
    _put(_arch, "paged_attention", "decode_cuda", "d>128", TOKENS_PER_THREAD=8, num_warps=4, **_split)

# The cluster decode (templates/paged_decode_cluster.cu.j2, variant decode_rotary_cluster): RotaryPagedAttention
# on decode steps of at most max_seqs sequences whose longest context is at most max_context (a CUDA graph's
# context bucket: 255), one thread-block cluster of `cluster` CTAs per (sequence, KV head) combining its
# partials through distributed shared memory. sm90 only (clusters); needs nvcc (else Triton's runs).
# H200 (bench/attn_b1_device.py, bench/results/h200_cluster_attn_b1.txt; us a launch behind a PDL
# predecessor, Triton's decode_rotary in brackets): 8B b1 ctx 128/192/256 4.47/4.82/5.36 (5.05/5.27/5.89),
# 1B b1 ctx 256 3.64 (7.04); but 8B b1 ctx 4096 15.13 (13.19): 8 CTAs a sequence stream long contexts
# slower than Triton's 33 splits, so max_context keeps them on Triton (1024: between 256 and 4096, not
# measured); 8B b4 ctx 192 9.92 (6.87; cluster 4: 6.42), so max_seqs 1; at b32 cluster 8 is 2-3x slower.
# max_seqs 4 end to end (bench/ab/cluster_max_seqs4.json, eighteenth session): b4 slower, int4 8B 2.174 against
# 2.014 ms a token, 1B 1.059 against 1.029.
# One cp.async stage, not two (bench/results/h200_af7148e_cluster_ab_int4.json, _stages_bf16.json): the kernel
# alone is as fast (cl8s1 4.46/4.79/5.29 us above), the bf16 steps are unchanged (8B graph 4.136/4.143 against
# 4.135/4.132 ms, 1B 0.876 both), but the int4 8B step with two stages (~99 KB of shared memory a CTA at 8B)
# ran slower than without the kernel (2.07 against 1.98 ms) and with one (~64 KB) faster (1.91).
for _bucket in ("d<=64", "d<=128"):
    _put("sm90", "paged_attention", "decode_cluster", _bucket, enabled=True, cluster=8, num_warps=4, stages=1,
         max_seqs=1, max_context=1024)

# smem_carveout 25 for the norms and the decode attention (every decode variant) on sm90. A 10-40% split for
# every kernel took the int4 8B batch-1 step from 1.92 to 1.89 ms but the bf16 8B step from 4.14 to 4.33
# (bench/results/h200_a5e314b_carveout_sweep.json); given to these kernels alone (bench/ab/norms_attn_carveout25.json,
# one lease each, h200_a70445a_carveout_ab.json): int4 + int4 head b1 1.895 ms against 1.920-1.923 (528.7
# against 522.7-523.7 tok/s), b32 5,447 against 5,461; bf16 8B b1 4.077 against 4.093 ms, b32 5,865 against 5,842.
for _key in [k for k in TUNE if k.startswith(("sm90/rms_norm/", "sm90/paged_attention/decode"))]:
    TUNE[_key]["smem_carveout"] = 25

# fp8_quant (per-token activation quantization) holds a whole row in registers: warps grow with the row.
for _bucket, _warps in (("block<=1024", 4), ("block<=4096", 8), ("block>4096", 16)):
    _put("sm90", "fp8_quant", "*", _bucket, num_warps=_warps, num_stages=1)

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
    _put(_arch, "gemv", "*", "m<=1", max_m=1, plain=False, BLOCK_M=4, BLOCK_N=8, BLOCK_K=1024, DOT=False,
         num_warps=4, num_stages=2, target_programs=2 * _SM_COUNT[_arch], max_splits=16, min_split_k_tiles=2,
         silu_by_n=((1, 2048, {"BLOCK_N": 4}),))
    # silu_by_n: (N lo, N hi (0: no bound), overrides) for the SiLU-fused down by its N (the hidden size):
    # BLOCK_N 8 leaves an N of 2048 only 256 programs; the sweep's best for the 1B down (K 8192, N 2048)
    # was BLOCK_N 4 (11.9 us) where this entry's BLOCK_N 8 ran 14.0 us (bench/results, run-pick)
    # classes kept for sweeps and tests (bench/gemv_device.py, tests/test_gemv.py); cuBLAS was faster
    _put(_arch, "gemv", "*", "m<=4", max_m=4, BLOCK_M=4, BLOCK_N=8, BLOCK_K=1024, DOT=False, num_warps=4,
         num_stages=2, target_programs=4 * _SM_COUNT[_arch], max_splits=16, min_split_k_tiles=2)
    _put(_arch, "gemv", "*", "m<=16", max_m=16, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, DOT=True, num_warps=4,
         num_stages=4, target_programs=4 * _SM_COUNT[_arch], max_splits=16, min_split_k_tiles=2)

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
    _plain_m1 = dict(max_m=1, BLOCK_M=4, DOT=False, num_stages=2, target_programs=2 * _SM_COUNT[_arch],
                     max_splits=16, min_split_k_tiles=2)
    _put(_arch, "gemv", "*", "m<=1/n4k1024w4", BLOCK_N=4, BLOCK_K=1024, num_warps=4,
         serves=(((1, 2048), (1, 2048)), ((2049, 0), (8193, 65535))), **_plain_m1)
    _put(_arch, "gemv", "*", "m<=1/n8k512w2", BLOCK_N=8, BLOCK_K=512, num_warps=2,
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
GEMV_CUDA_M_CLASSES = ("m<=8",)
for _arch in ("sm80", "sm90"):
    _put(_arch, "gemv", "cuda", "m<=8", max_m=8, plain=False, silu=False, max_n=0, num_warps=4, TILES=2,
         UNROLL=4, min_blocks=4, ACC_SPLIT=1, target_programs=4 * _SM_COUNT[_arch], max_splits=16,
         min_split_k_tiles=1)

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
_fp8_split = dict(target_programs=2 * _SM_COUNT["sm90"], max_splits=16, min_split_k_tiles=4)
_put("sm90", "fp8_linear", "*", "m<=16", max_m=16, fuse_quant=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256,
     num_warps=4, num_stages=4, **_fp8_split)
_put("sm90", "fp8_linear", "*", "m<=32", max_m=32, BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=8,
     num_stages=4, **_fp8_split)
_put("sm90", "fp8_linear", "*", "m<=64", max_m=64, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8,
     num_stages=4, **_fp8_split)
_put("sm90", "fp8_linear", "*", "m<=128", max_m=128, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8,
     num_stages=4, **_fp8_split)
_put("sm90", "fp8_linear", "*", "m<=256", max_m=256, BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, num_warps=8,
     num_stages=3, **_fp8_split)

# Per input width K of the Llama-3-8B shape, the best of the H200 sweep at M=32 and 64 (bench/fp8_device.py,
# 2026-11-30, bench/results/h200_fp8_kernels_v3.txt; the lookup takes an exact variant before '*'): the
# table above gave qkv+o+gate_up 69.7 us and down 28.6 us at M=64; these 57.3 and 21.0 us. Other widths
# keep the '*' entries (not measured).
_put("sm90", "fp8_linear", "k4096_m32", "m<=32", max_m=32, BLOCK_M=32, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4, target_programs=1 * _SM_COUNT["sm90"], max_splits=16, min_split_k_tiles=4)
_put("sm90", "fp8_linear", "k14336_m32", "m<=32", max_m=32, BLOCK_M=32, BLOCK_N=64, BLOCK_K=256, num_warps=8, num_stages=5, target_programs=1 * _SM_COUNT["sm90"], max_splits=16, min_split_k_tiles=4)
_put("sm90", "fp8_linear", "k4096_m64", "m<=64", max_m=64, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=6, target_programs=1 * _SM_COUNT["sm90"], max_splits=16, min_split_k_tiles=4)
_put("sm90", "fp8_linear", "k14336_m64", "m<=64", max_m=64, BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=6, target_programs=1 * _SM_COUNT["sm90"], max_splits=16, min_split_k_tiles=4)

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
                   target_programs=_SM_COUNT[_arch], max_splits=16, min_split_k_tiles=4)
    _put(_arch, "skinny_gemm", "*", "m<=16", min_m=9, max_m=16, BLOCK_M=16, num_stages=_stages, **_skinny)
    _put(_arch, "skinny_gemm", "*", "m<=32", min_m=17, max_m=32, BLOCK_M=32, num_stages=_stages, **_skinny)
    _put(_arch, "skinny_gemm", "*", "m<=64", min_m=33, max_m=64, BLOCK_M=64, num_stages=_stages - 1, **_skinny)
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
    _put("sm90", "skinny_gemm", f"k4096_m{_m}", f"m<={_m}", **dict(_generic, num_stages=4, enabled=True))
    _put("sm90", "skinny_gemm", f"silu_k14336_m{_m}", f"m<={_m}",
         **dict(_generic, BLOCK_N=128, num_warps=8, num_stages=4, enabled=True))

# Not here: a residual add + RMSNorm fused into these kernels' input tiles (kernels/norm_linear, 23d4a5c,
# reverted). In a swap-AB kernel every program reads and transforms all of x for its W rows, so the fusion
# multiplies the norm's work by the N tiles (and x and the residual took pipeline stages, halving programs an
# SM): on the H200 it took the 8B's qkv 23.8-40.3 us against 17.0-17.7 for add_rms_norm + this GEMM, gate_up
# 64-124 against 60-62, and b32 128/128 to 3,707-5,483 tok/s against 6,026
# (bench/results/h200_23d4a5c_norm_linear_*). The separate norm kernel normalizes x once.

# int4_linear (W4A16), not yet measured on a device (bench/int4_device.py sweeps these). GEMV: a tile is
# BLOCK_N rows x BLOCK_C 16-byte chunks (32 weights each); threads and warps all run along K (BLOCK_C =
# 32 * num_warps: one chunk per thread and row), rows stay in registers, so x's loads share the words'
# layout (no shared-memory shuffles; a smaller BLOCK_C gives x tiles of one element per thread, which
# Triton then converts through shared memory every plane). Each row of x adds [BLOCK_N, 4] fp32 partials
# per thread, so BLOCK_N shrinks as BLOCK_M grows. target_programs: below that many N tiles the GEMV
# splits K (+ a reduce launch); the 8B projections have 1024+ tiles and never split. gemv_max_rows: the
# largest M that runs the GEMV; above it the dequant kernel writes W [N, K] and cuBLAS multiplies.
for _arch in ("sm80", "sm90"):
    _gemv = dict(BLOCK_C=128, num_warps=4, num_stages=1, gemv_max_rows=8, target_programs=_SM_COUNT[_arch],
                 max_splits=16)
    for _rows, _block_n in ((1, 4), (2, 4), (4, 2), (8, 1)):
        _put(_arch, "int4_linear", "*", f"gemv_m{_rows}", BLOCK_N=_block_n, **_gemv)
    _put(_arch, "int4_linear", "*", "gemv_reduce", BLOCK=512, num_warps=4, num_stages=1)
    _put(_arch, "int4_linear", "*", "dequant", BLOCK_N=4, BLOCK_C=128, num_warps=4, num_stages=1)
    # The CUDA C++ int4 GEMV (templates/int4_gemv.cu.j2: magic-number dequant in registers, tensor-core mma,
    # any M <= max_m <= 8 for the cost of one), run in place of the Triton GEMV for M <= max_m where
    # enabled and nvcc was there at build time. Tiles as for the bf16 CUDA GEMV, but a K step is 128 wide
    # (BLOCK_K = 128 * warps * UNROLL); split K (in-kernel, last-arriver) until target_programs CTAs.
    # H200 (bench/int4_cuda_device.py, 2026-11-30, bench/results/h200_int4_cuda.txt): the 8B projections'
    # GEMVs of a decode step take 2.0 ms at M=1..8 against Triton int4 2.6 ms (M=1) to 31.5 ms (M=8) and
    # bf16 3.8 ms; this config was the best over the sweep. sm80: by analogy, not measured.
    # A stream-K rewrite with a cp.async W pipeline (ce78d4e) measured 2.63-2.69 ms at its best configs
    # (bench/results/h200_int4_cuda_streamk.txt) and was reverted.
    # ZERO_SUM (the zero off each step's sum, one packed op fewer per pair): 0.4-1.7% faster in three H200
    # sweeps (bench/results/h200_59ba135_int4_variants.txt). Not kept from that sweep: PREFETCH (loads of
    # the next iteration in flight during this one: 5-7% slower at 3 CTAs an SM), and W in 16-row tiles with
    # packed [groups, N] scale|zero words (2-4% faster, but every int4 reader would need the layout). Nor W
    # through a shared-memory ring filled by cp.async.bulk (5a04ded, reverted): 79 us a layer at M=1 against
    # 57, and its loads alone 57 against 41 (bench/results/h200_5a04ded_int4_ring.txt). Nor a streaming GEMV
    # (889aa03, reverted: one CTA an SM, each warp its own ring of whole items by bulk copies started before
    # the PDL wait, 8-16 warps): the 8B's projections at M=1 took 82-88 us a layer against 57, gate_up 35 us
    # against 25, although its copies alone streamed gate_up at 3.0 TB/s (the register loads: 3.35); its
    # dequant and mma could not keep up at one CTA an SM. And an L2 prefetch of the CTA's W rows before the
    # wait (L2_PREFETCH, 889aa03) made every projection slower (gate_up 30.6 us; h200_889aa03_int4_stream*).
    # Nsight Compute on this config at M=1 (bench/int4_gemv_ncu.py, h200_4e0a94b_int4_ncu.txt): gate_up issues
    # in 37% of cycles and streams 2.35 TB/s; 48% of its warps' stall samples wait on the W loads (long
    # scoreboard), 18% on fixed-latency results; 110 registers hold it at 4 CTAs (16 warps) an SM. Yet more CTAs
    # an SM (min_blocks 5/6/8 capping 96/80/64 registers) or 8 warps were no faster on any 8B projection
    # (h200_4e0a94b_int4_occupancy.txt): more warps waiting the same way do not fill the gap. Nor more W bytes in
    # flight a warp (UNROLL 2-4 or TILES 4 at 2-4 CTAs an SM: 60-64 us a layer against 57, h200_8498b70_int4_inflight).
    # Nor a W stash (3706234, reverted): each CTA copying its W rows over its first K tiles into shared memory
    # by cp.async before the PDL wait, so the o GEMV loads during the decode attention and qkv during a norm
    # (the latency-bound kernels' DRAM-idle time the persistent_chain skeleton measured): int4 8B b1 2.073 ms
    # with o's stash (4 tiles, 35 KB a CTA), 2.144 with o's and qkv's, against 1.896 stock in one lease
    # (bench/results/h200_3706234_*); outputs correct. Likely the same cost as the two-stage cluster decode's:
    # a GEMV CTA that needs that much shared memory cannot share an SM with the attention's until the SM's
    # L1/shared split changes, which waits for the SM to drain.
    # ACC_SPLIT (twelfth session): a step's 8 dependent mmas split over 2 accumulators, on the 18% of fixed-latency
    # waits: the 8B's projection GEMVs of a layer at M=1 took 53.4 us against 55.5 (gate_up 23.5 against 24.9,
    # down 15.0 / 15.6, o 6.9 / 7.1), at M=8 60.5 against 63.0 (bench/results/h200_3b3b03d_int4_split.txt).
    # silu_out: also build its twin that writes silu(gate) * up of a fused gate_up (QLinearSiluMul), so a decode
    # step of at most max_m rows has no silu_mul launch: 8B int4 b1 509.2-509.6 tok/s against 507.3 without it,
    # A-B-A in one lease (graph 2.010 against 2.024 ms; bench/results/h200_a3feda7_*silu*).
    # EARLY_W (nineteenth session): the CTA's first K tile of W, scales and zeros loaded before the PDL wait,
    # in registers (the stash above used shared memory), so a GEMV behind a latency-bound kernel streams
    # some of its weights during it. H200, int4 + int4 head 8B b1, one lease (bench/ab/int4_early_w_*.json,
    # bench/results/h200_aaf65f2_int4_early_w.json): on every int4 GEMV 1.972 ms a step against 1.889-1.890
    # stock; on o alone (behind the decode attention) 1.878: on for o's shape only (below).
    # Nor an L2 bulk prefetch of the CTA's W rows one or two K tiles ahead (cp.async.bulk.prefetch.L2 a row at
    # the top of each tile, 625d0db, reverted): 2.514 / 2.571 ms a step against 1.878-1.881, the int4 GEMVs
    # 34-37% slower (bench/results/h200_625d0db_int4_l2_prefetch.json), as the L2 prefetch before the wait was.
    _put(_arch, "int4_linear", "cuda", "gemv", enabled=True, max_m=8, num_warps=4, TILES=2, UNROLL=1,
         min_blocks=4, ZERO_SUM=True, ACC_SPLIT=2, target_programs=2 * _SM_COUNT[_arch], max_splits=16,
         min_split_k_tiles=1, silu_out=True, EARLY_W=False)
    # ... and, per projection shape [N, K] where one config beat it, a build of its own (gemv_n{N}_k{K}, variant
    # cuda_g{G}_n{N}_k{K}, made where a model has that shape; the runtime prefers it up to its max_m). H200
    # (bench/int4_cuda_device.py; h200_5b7e245_int4_cuda.txt, h200_b1c505b_int4_cuda.txt): the 8B's qkv
    # [6144, 4096] at M=1/2/4/8 took 8.14/8.23/8.83/10.48 us with 16-row tiles and two K steps an iteration,
    # against 9.31/9.44/9.56/10.54 with this entry (8.13 against 9.30 at M=1 in the earlier sweep). o, gate_up and
    # down had no better config than this one.
    if _arch == "sm90":
        _put(_arch, "int4_linear", "cuda", "gemv_n6144_k4096", enabled=True, max_m=8, num_warps=4, TILES=1,
             UNROLL=2, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=1, target_programs=2 * _SM_COUNT[_arch],
             max_splits=16, min_split_k_tiles=1, EARLY_W=False)   # ACC_SPLIT 2: 8.08 us against 7.98 (its two K steps: two chains)
        # the 8B's o [4096, 4096], which runs behind the decode attention: the generic config with EARLY_W
        # (1.878 ms a step against 1.889 / 1.890 in an A-B-A lease, b4 2.006 against 2.021 / 2.022 a token).
        # Four splits (target_programs 528, so the CTAs' first tiles cover half of W): 1.878 against 1.878-1.881
        # with these: not taken (bench/results/h200_625d0db_int4_l2_prefetch.json)
        _put(_arch, "int4_linear", "cuda", "gemv_n4096_k4096", enabled=True, max_m=8, num_warps=4, TILES=2,
             UNROLL=1, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=2, target_programs=2 * _SM_COUNT[_arch],
             max_splits=16, min_split_k_tiles=1, EARLY_W=True)
    # ... and built for up to 16 and 32 rows (X_TILES = max_m / 8 n8 tiles of x share each dequantized W
    # fragment), serving M 9-16 and 17-32 in place of dequant + cuBLAS. H200, the 8B projections of a decode
    # step (bench/int4_cuda_device.py, bench/results/h200_5b7e245_int4_cuda.txt): M=16 3.19 ms, M=32 5.66 ms,
    # each the best config of the sweep at its M, against bf16 4.02 / 4.16 and dequant + cuBLAS ~14 (the CUDA
    # dequant's times + the bf16 GEMMs) to 26.8 (the Triton dequant).
    # (ACC_SPLIT 1: their X_TILES n8 tiles of x are already that many independent chains; not measured split)
    _put(_arch, "int4_linear", "cuda", "gemv_wide16", enabled=True, max_m=16, num_warps=4, TILES=2, UNROLL=1,
         min_blocks=3, ZERO_SUM=True, ACC_SPLIT=1, target_programs=2 * _SM_COUNT[_arch], max_splits=16,
         min_split_k_tiles=1)
    _put(_arch, "int4_linear", "cuda", "gemv_wide32", enabled=True, max_m=32, num_warps=4, TILES=2, UNROLL=1,
         min_blocks=2, ZERO_SUM=True, ACC_SPLIT=1, target_programs=2 * _SM_COUNT[_arch], max_splits=16,
         min_split_k_tiles=1)
    # ... and its prefill dequant (templates/int4_dequant.cu.j2): CHUNKS 16-byte chunks per thread, all
    # loaded before the first is written. H200: 1.3-1.45 TB/s written, about twice the Triton dequant.
    _put(_arch, "int4_linear", "cuda", "dequant", enabled=True, num_warps=8, CHUNKS=2)

# int4_gemm (W4A16 GEMM of decode batches over the engc int4 layout, kernels/int4_gemm), one entry per M
# class: the rows past the CUDA int4 GEMV's sweet spot, where dequantizing each weight once per program and
# multiplying it by every row on the tensor cores beats both the GEMV (which dequantizes again per 8 rows)
# and dequant + cuBLAS (bf16 W written and read back). BLOCK_M is the MMA's narrow side (swap AB); the
# classes past 64 rows take 128-row M tiles (M=256: two, each reading W). PAIRS (bf16 only): the CUDA
# GEMV's magic-pair dequant in inline PTX, one LOP3 and two bf16x2 FMAs a pair of weights, where the float32
# path spends ~6 operations a weight. Gathering x in the layout's interleaved order instead of permuting
# the W tile in registers was slower with either dequant (183cfce's PERM_X; bench/results/h200_int4_gemm_pairs.txt).
# H200 sweeps (bench/int4_gemm_device.py; the 8B's projections of a decode step, 32 layers, ms):
#   float32 dequant (bench/results/h200_2d4cf76_int4_gemm.txt): 0.46-0.68x bf16 cuBLAS at every M;
#   PAIRS, BLOCK_N 64 x BLOCK_K 128 (bench/results/h200_int4_gemm_pairs.txt), against today's path before it:
#     M=16 3.71 vs CUDA GEMV 3.14 (off: the GEMV stays); M=24/32 4.24/4.25 vs 5.12/5.64; M=48/64 5.02/5.00
#     vs two GEMV passes 8.66/11.15; M=128 8.77 vs dequant + cuBLAS 14.41; M=256 15.99 vs 15.87.
#   128-row M tiles past 64 rows (bench/results/h200_int4_gemm_m128.txt), BLOCK_M 128 x BLOCK_N 64 x BLOCK_K 64:
#     M=96/128 7.06/7.09 (64-row tiles 8.77), M=192/256 12.06/11.99 vs dequant + cuBLAS 15.28/15.88.
#   bf16 cuBLAS for scale: 3.9-4.4 ms up to 128 rows, 5.3/5.9 at 192/256. Past 256 rows (prefill) the
#   dequant + cuBLAS path stays.
# sm80: not measured, off.
INT4_GEMM_M_CLASSES = ("m<=16", "m<=32", "m<=64", "m<=128", "m<=256")
for _arch, _stages in (("sm80", 3), ("sm90", 4)):
    _int4_gemm = dict(enabled=False, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=_stages,
                      PAIRS=_arch == "sm90", target_programs=2 * _SM_COUNT[_arch], max_splits=16,
                      min_split_k_tiles=2)
    for _bucket, _min_m, _block_m, _block_k in (("m<=16", 9, 16, 128), ("m<=32", 17, 32, 128),
                                                ("m<=64", 33, 64, 128), ("m<=128", 65, 128, 64),
                                                ("m<=256", 129, 128, 64)):
        _put(_arch, "int4_gemm", "*", _bucket, min_m=_min_m, max_m=int(_bucket[3:]), BLOCK_M=_block_m,
             **dict(_int4_gemm, BLOCK_K=_block_k, enabled=_arch == "sm90" and _bucket != "m<=16"))
# smem_carveout (the preferred L1/shared-memory split, a launch constant): the H200 8B int4 + int4 head
# bundle at batch 32 (128/128, this class's GEMMs) ran 5,472 / 5,480 tok/s with 40% against 5,147-5,158
# with the driver's choice, the same cubins in another lease of the session (bench/results/
# h200_c60ec85_int4_carveout.json). A split for the whole bundle showed the range: 25% 4,316, 40-50% 5,451-5,463,
# 60% 5,168. The 33-256-row classes at 40% lost a fifth (b64 6,703 against 8,500, b256 9,634 against 11,854 in
# one lease: h200_a70445a_carveout_ab.json): driver's choice there.
TUNE["sm90/int4_gemm/*/m<=32"]["smem_carveout"] = 40

_put("sm90", "paged_attention", "prefill", "d<=64", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
_put("sm90", "paged_attention", "prefill", "d<=128", BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
_put("sm90", "paged_attention", "prefill", "d>128", BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
_put("sm80", "paged_attention", "prefill", "d<=64", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
_put("sm80", "paged_attention", "prefill", "d<=128", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
_put("sm80", "paged_attention", "prefill", "d>128", BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)


def block_bucket(block: int) -> str:
    return "block<=1024" if block <= 1024 else "block<=4096" if block <= 4096 else "block>4096"


def head_dim_bucket(head_dim: int) -> str:
    return "d<=64" if head_dim <= 64 else "d<=128" if head_dim <= 128 else "d>128"


def lookup(arch: str, op: str, variant: str, bucket: str, overrides: dict | None = None) -> tuple[str, dict]:
    """The tune entry for a kernel: exact variant first, then the op's '*' entry."""
    for key in (f"{arch}/{op}/{variant}/{bucket}", f"{arch}/{op}/*/{bucket}"):
        if key in TUNE:
            entry = dict(TUNE[key])
            if overrides:
                entry.update(overrides)
                key += "+override"
            return key, entry
    raise KeyError(f"no tune-table entry for {arch}/{op}/{variant}/{bucket}")


# Fields an override may add to an entry that does not spell them out (PDL: read with a per-arch default;
# smem_carveout: absent means the driver's choice).
OPTIONAL_FIELDS = ("PDL", "smem_carveout")


def launch_carveout(entry: dict) -> dict:
    """An entry's preferred L1/shared-memory split (percent of the most shared memory an SM can have; -1 no
    preference) as the launch constant its records carry, {} where the entry names none (the driver picks).
    A launch constant, not a compile one: the runtime sets it on the loaded kernel, the cubin is the same."""
    if "smem_carveout" not in entry:
        return {}
    value = entry["smem_carveout"]
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= 100:
        raise ValueError(f"smem_carveout {value!r}: expected a percent 0..100 or -1 (no preference)")
    return {"smem_carveout": value}


# The key of a tune file's provenance (`engc tune` writes GPU, versions, date, measurements there): skipped
# and dropped by check_overrides, so it reaches neither the kernels, the kernel cache nor the manifest, and
# two tune files with the same entries build the same bundle.
META_KEY = "_meta"


def check_overrides(entries, where: str = "--tune") -> dict:
    """A tune-table override ({"arch/op/variant/bucket": {field: value}}, e.g. from `engc build --tune
    FILE`), checked: every key an entry of the table, every field one that entry has (or PDL), every value
    a number, string, bool or list of them. Typos would otherwise be ignored silently. Returns the entries
    without META_KEY."""
    from engc.errors import UserError
    if not isinstance(entries, dict):
        raise UserError(f"{where}: expected a JSON object of tune entries, got {type(entries).__name__}")
    entries = {key: fields for key, fields in entries.items() if key != META_KEY}
    for key, fields in entries.items():
        if key not in TUNE:
            near = sorted(k for k in TUNE if k.split("/")[1:2] == key.split("/")[1:2])[:6]
            raise UserError(f"{where}: no tune entry '{key}'" + (f"; that op has {', '.join(near)}" if near else ""))
        if not isinstance(fields, dict) or not fields:
            raise UserError(f"{where}: '{key}' must map to an object of fields")
        for name, value in fields.items():
            if name not in TUNE[key] and name not in OPTIONAL_FIELDS:
                raise UserError(f"{where}: '{key}' has no field '{name}'; it has {', '.join(sorted(TUNE[key]))}")
            if not isinstance(value, (int, float, str, bool, list)):
                raise UserError(f"{where}: '{key}'.{name} must be a number, string, bool or list")
    return entries


@contextmanager
def overridden(entries: dict | None):
    """The table with `entries` (check_overrides' form) merged over it, for the duration of one build."""
    saved = {key: TUNE.get(key) for key in entries or {}}
    try:
        for key, fields in (entries or {}).items():
            TUNE[key] = {**TUNE[key], **fields}
        yield
    finally:
        for key, entry in saved.items():
            TUNE[key] = entry
