"""Tune entries of the int4 (W4A16) path: the Triton GEMV and dequant, the CUDA C++ GEMV builds (M <= 8,
per projection shape, 16 and 32 rows) and dequant, and the int4 GEMM of 9-256 rows."""
from __future__ import annotations

from engc.compiler.codegen.tune.table import SM_COUNT, TUNE, put

# int4_linear (W4A16), not yet measured on a device (bench/int4_device.py sweeps these). GEMV: a tile is
# BLOCK_N rows x BLOCK_C 16-byte chunks (32 weights each); threads and warps all run along K (BLOCK_C =
# 32 * num_warps: one chunk per thread and row), rows stay in registers, so x's loads share the words'
# layout (no shared-memory shuffles; a smaller BLOCK_C gives x tiles of one element per thread, which
# Triton then converts through shared memory every plane). Each row of x adds [BLOCK_N, 4] fp32 partials
# per thread, so BLOCK_N shrinks as BLOCK_M grows. target_programs: below that many N tiles the GEMV
# splits K (+ a reduce launch); the 8B projections have 1024+ tiles and never split. gemv_max_rows: the
# largest M that runs the GEMV; above it the dequant kernel writes W [N, K] and cuBLAS multiplies.
for _arch in ("sm80", "sm90"):
    _gemv = dict(BLOCK_C=128, num_warps=4, num_stages=1, gemv_max_rows=8, target_programs=SM_COUNT[_arch],
                 max_splits=16)
    for _rows, _block_n in ((1, 4), (2, 4), (4, 2), (8, 1)):
        put(_arch, "int4_linear", "*", f"gemv_m{_rows}", BLOCK_N=_block_n, **_gemv)
    put(_arch, "int4_linear", "*", "gemv_reduce", BLOCK=512, num_warps=4, num_stages=1)
    put(_arch, "int4_linear", "*", "dequant", BLOCK_N=4, BLOCK_C=128, num_warps=4, num_stages=1)
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
    # stock; on o alone (behind the decode attention) 1.878: on for o's shape only (below). On qkv as well (behind
    # its norm): 1.904 against 1.885-1.890 (bench/results/h200_2c302a9_engc_8b-int4-qhead.json).
    # What lost when every GEMV had it (twentieth session; down and the head on builds of their own for the A/B,
    # a9f7ec7): gate_up's SiLU-out build, 1.944 ms a step against 1.882 stock (twice); down alone (behind
    # gate_up's last partial wave) 1.883, no gain; neither taken (bench/results/h200_a9f7ec7_int4_early_w_split.json).
    # gate_up's SiLU-out build split in two (1,792 CTAs instead of 896 over 528 slots, target_programs 1000 with
    # max_splits 4, which leaves down and the head as they are): 27.2 us a layer in the chain against 23.0
    # (bench/results/h200_2c302a9_gate_up_split2_*): its 1.7 waves are not what it loses.
    # Nor an L2 bulk prefetch of the CTA's W rows one or two K tiles ahead (cp.async.bulk.prefetch.L2 a row at
    # the top of each tile, 625d0db, reverted): 2.514 / 2.571 ms a step against 1.878-1.881, the int4 GEMVs
    # 34-37% slower (bench/results/h200_625d0db_int4_l2_prefetch.json), as the L2 prefetch before the wait was.
    # Nor W, x, scales and zeros through a per-lane cp.async ring in shared memory STAGES - 1 K tiles ahead
    # (909dc24, reverted: each lane copied what it would read, so wait_group was the only synchronization):
    # at M=1 gate_up 47.9 us (3 stages, 3 CTAs an SM) / 52.3 (2 stages, 4 CTAs) against 24.6 stock, and its
    # copies alone (ABLATE) 46.7 us; with only W's copies left (no x, no scale / zero words) 24.8, against the
    # register loads alone at 18.0 (3.4 TB/s): cp.async into shared memory streams this GEMV's W at ~2.5 TB/s,
    # about what the whole register kernel does, so no overlap of the math could win. The 8B int4 b1 step:
    # 2.90-3.00 ms against 1.885 (bench/results/h200_909dc24_int4_stages.json).
    # Nor PREFETCH again (096a359, reverted; the fourteenth session's was at 3 CTAs an SM): the next K tile's W,
    # scales and zeros in a second register set before this tile's math, at 4 CTAs an SM (128 registers):
    # the 8B's four projections at M=1 61.3 us against 56.7 (ACC_SPLIT 1: 60.3; 16-row tiles at 4-6 CTAs an SM
    # 64-69), its loads alone as fast as the loop's (bench/results/h200_096a359_int4_prefetch.txt). By one- and
    # two-wave shapes (h200_096a359_int4_waves.txt) the GEMV costs ~3.4 us a launch plus 2.77 TB/s, its loads
    # alone 1.9 us plus 3.73 TB/s; an exact wave is no faster a byte than gate_up's 1.7, so no stream-K either.
    # PACKED_SZ (d0a44c6 measured it as a plain build): a 16-row tile's scales and zeros as one 8-byte word a row
    # pair, one load a tile and K step instead of four: M=1 alone gate_up 23.48 us against 24.13, down 14.58 / 15.13,
    # head 85.36 / 88.21 (bench/results/h200_d0a44c6_int4_packed_sz.txt): ~2.3% of a b1 step predicted. On for this
    # build and its SiLU-out twin (gate and up rows paired; int4_linear.pack_scales_zeros, made at load by
    # runtime/quant_ops.prepack_int4); off for qkv's (7.85 against 7.83 us), the wide builds and o's EARLY_W build
    # (checked since, no gain: its entry below says).
    # In the engine (h200_4cc272f_packed_sz_ab.json): b1 1.859-1.866 ms a step against 1.870, b4 -1.5% a token.
    # Twenty-fourth session, not kept: EARLY_W on qkv's build packed (no spills now) still 11 us a step slower
    # (h200_4335c28_qkv_early_w_packed_ab.json); warps' first loads staggered by a sleep (no lockstep-phase loss:
    # h200_4335c28_int4_stagger.txt); loads at constant offsets of stepped pointers, 8% fewer loop instructions
    # and 11 fewer registers, no faster (c2f0790, h200_step_ptrs_int4.txt): this GEMV's time is its loads' latency,
    # not its issue slots. One launch over a layer's four projections' bytes would take 40.1 us against 46.4 for
    # the four in the engine's chain (h200_c707157_int4_one_launch.txt): the bound of a dataflow kernel.
    # Twenty-sixth session (h200_2e521a4_int4_tiled_micro.txt): the W loads alone take as long at 8 K steps a warp
    # in flight as at 1 (gate_up 18.0-18.6 us, the head 65 us: 4.2 TB/s), where the full loop loses 5-20% with
    # them: the loss is the math's interplay with the loads, not the memory side. Read as if a CTA's K tile were
    # one contiguous run (TILED, addresses only), this build gains 2-3.5% (gate_up 23.41 against 23.95 us, the
    # head 82.38 / 85.39): too little for a layout every int4 reader would have to follow.
    # MAXNREG (0: off, min_blocks rules): the registers a thread at most. Bench builds without the loop's x-only
    # work (NO_XSUM + NO_XPERM, wrong results) came out at 96 registers, where ncu shows 5 CTAs an SM instead of 4
    # (achieved occupancy 29.5% against 23.8%), and took the head 84.94 -> 76.74 us, gate_up 23.38 -> 22.74, down
    # 14.50 -> 13.95; with only one of the two off (106 / 110 registers, 4 CTAs) they were slower
    # (h200_7f4c310_int4_xwork_micro.txt, _ncu.json). min_blocks 5 never gave 5 CTAs: ptxas took 102 registers,
    # rounded up to 104 by the 8-a-thread allocation unit. This build at MAXNREG 96 compiles without spills; not
    # yet timed (bench/ab/int4_maxnreg96.json waits).
    # partials_out (twenty-first session): a launch that splits K and feeds an AddRMSNorm (o, down:
    # QLinearAddRMSNorm) stores its fp32 partials and exits; the norm sums them in split order (the same
    # bits). H200, M=1, the table's config alone (bench/int4_cuda_device.py DEFER, h200_4d1cde1_int4_defer.txt):
    # o 5.46 us against 6.82 with the in-launch reduce, down 13.96 against 15.22: the fence, the ticket and
    # the last split's re-read of the partials are ~1.3 us of each launch. In the 8B int4 b1 step the norm, one
    # CTA at M=1, then takes 2.30 us instead of 1.13 (four fp32 partials, 64 KB, where it read 8 KB), so the
    # step gains only 6-10 us: 1.874-1.876 ms against 1.881-1.884 in two leases (h200_e79a72b_int4_partials_ab.json,
    # h200_9d73c08_int4_cluster_ab.json). Not kept from the same lease: the splits reduced through a
    # thread-block cluster's shared memory (cluster_k 4 on o and down, 9d73c08, reverted): o 8.66 us against
    # 6.88 alone, down 19.64 against 15.67, the step 2.12 ms (h200_9d73c08_int4_cluster_micro.json): clusters of
    # four split CTAs cost far more than the global reduce they replace.
    put(_arch, "int4_linear", "cuda", "gemv", enabled=True, max_m=8, num_warps=4, TILES=2, UNROLL=1,
         min_blocks=4, ZERO_SUM=True, ACC_SPLIT=2, target_programs=2 * SM_COUNT[_arch], max_splits=16,
         min_split_k_tiles=1, silu_out=True, EARLY_W=False, partials_out=True, PACKED_SZ=True, MAXNREG=0)
    # ... and, per projection shape [N, K] where one config beat it, a build of its own (gemv_n{N}_k{K}, variant
    # cuda_g{G}_n{N}_k{K}, made where a model has that shape; the runtime prefers it up to its max_m). H200
    # (bench/int4_cuda_device.py; h200_5b7e245_int4_cuda.txt, h200_b1c505b_int4_cuda.txt): the 8B's qkv
    # [6144, 4096] at M=1/2/4/8 took 8.14/8.23/8.83/10.48 us with 16-row tiles and two K steps an iteration,
    # against 9.31/9.44/9.56/10.54 with this entry (8.13 against 9.30 at M=1 in the earlier sweep). o, gate_up and
    # down had no better config than this one.
    if _arch == "sm90":
        # (ACC_SPLIT 2: 8.08 us against 7.98; its two K steps are already two chains)
        put(_arch, "int4_linear", "cuda", "gemv_n6144_k4096", enabled=True, max_m=8, num_warps=4, TILES=1,
             UNROLL=2, min_blocks=4, ZERO_SUM=True, ACC_SPLIT=1, target_programs=2 * SM_COUNT[_arch],
             max_splits=16, min_split_k_tiles=1, EARLY_W=False, partials_out=True, PACKED_SZ=False)
        # the 8B's o [4096, 4096], which runs behind the decode attention: the generic config with EARLY_W
        # (1.878 ms a step against 1.889 / 1.890 in an A-B-A lease, b4 2.006 against 2.021 / 2.022 a token).
        # Four splits (target_programs 528, so the CTAs' first tiles cover half of W): 1.878 against 1.878-1.881
        # with these: not taken (bench/results/h200_625d0db_int4_l2_prefetch.json)
        # (silu_out is the generic build's alone: a per-shape build has no SiLU-out twin)
        # PACKED_SZ off: its EARLY_W form is correct (bench/int4_cuda_device.py's w4t2u1b4z_s2_ke, 1716/1716 checks,
        # h200_fbe6334_int4_roll_u8_micro.txt) but gained nothing in the step (1.858 ms against 1.853 in one lease,
        # h200_fbe6334_int4_roll_ab.json; the twenty-fourth session's A/B, all builds packed, had -4 to -11 us)
        put(_arch, "int4_linear", "cuda", "gemv_n4096_k4096",
            **{**{k: v for k, v in TUNE[f"{_arch}/int4_linear/cuda/gemv"].items() if k != "silu_out"}, "EARLY_W": True,
               "PACKED_SZ": False})
    # ... and built for up to 16 and 32 rows (X_TILES = max_m / 8 n8 tiles of x share each dequantized W
    # fragment), serving M 9-16 and 17-32 in place of dequant + cuBLAS. H200, the 8B projections of a decode
    # step (bench/int4_cuda_device.py, bench/results/h200_5b7e245_int4_cuda.txt): M=16 3.19 ms, M=32 5.66 ms,
    # each the best config of the sweep at its M, against bf16 4.02 / 4.16 and dequant + cuBLAS ~14 (the CUDA
    # dequant's times + the bf16 GEMMs) to 26.8 (the Triton dequant).
    # (ACC_SPLIT 1: their X_TILES n8 tiles of x are already that many independent chains; not measured split)
    put(_arch, "int4_linear", "cuda", "gemv_wide16", enabled=True, max_m=16, num_warps=4, TILES=2, UNROLL=1,
         min_blocks=3, ZERO_SUM=True, ACC_SPLIT=1, target_programs=2 * SM_COUNT[_arch], max_splits=16,
         min_split_k_tiles=1, partials_out=True)
    put(_arch, "int4_linear", "cuda", "gemv_wide32", enabled=True, max_m=32, num_warps=4, TILES=2, UNROLL=1,
         min_blocks=2, ZERO_SUM=True, ACC_SPLIT=1, target_programs=2 * SM_COUNT[_arch], max_splits=16,
         min_split_k_tiles=1, partials_out=True)
    # ... and its prefill dequant (templates/int4_dequant.cu.j2): CHUNKS 16-byte chunks per thread, all
    # loaded before the first is written. H200: 1.3-1.45 TB/s written, about twice the Triton dequant.
    put(_arch, "int4_linear", "cuda", "dequant", enabled=True, num_warps=8, CHUNKS=2)

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
                      PAIRS=_arch == "sm90", target_programs=2 * SM_COUNT[_arch], max_splits=16,
                      min_split_k_tiles=2)
    for _bucket, _min_m, _block_m, _block_k in (("m<=16", 9, 16, 128), ("m<=32", 17, 32, 128),
                                                ("m<=64", 33, 64, 128), ("m<=128", 65, 128, 64),
                                                ("m<=256", 129, 128, 64)):
        put(_arch, "int4_gemm", "*", _bucket, min_m=_min_m, max_m=int(_bucket[3:]), BLOCK_M=_block_m,
             **dict(_int4_gemm, BLOCK_K=_block_k, enabled=_arch == "sm90" and _bucket != "m<=16"))
# smem_carveout (the preferred L1/shared-memory split, a launch constant): the H200 8B int4 + int4 head
# bundle at batch 32 (128/128, this class's GEMMs) ran 5,472 / 5,480 tok/s with 40% against 5,147-5,158
# with the driver's choice, the same cubins in another lease of the session (bench/results/
# h200_c60ec85_int4_carveout.json). A split for the whole bundle showed the range: 25% 4,316, 40-50% 5,451-5,463,
# 60% 5,168. The 33-256-row classes at 40% lost a fifth (b64 6,703 against 8,500, b256 9,634 against 11,854 in
# one lease: h200_a70445a_carveout_ab.json): driver's choice there.
TUNE["sm90/int4_gemm/*/m<=32"]["smem_carveout"] = 40
