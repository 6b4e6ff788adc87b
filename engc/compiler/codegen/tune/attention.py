"""Tune entries of the paged attention kernels: decode (Triton, the CUDA twin, the cluster decode) and
prefill, and the shared-memory split of the decode kernels and norms.

The first sm90 decode and prefill entries and the decode split rule came from sweeps on an H200 with
bench/kernels_device.py (Llama-3-8B and Llama-3.2-1B attention shapes, bf16): decode d=64 BLOCK_N 128 and
d=128 BLOCK_N 64 were best or within noise on most of B 1/32/64 x ctx 512/4096; prefill m64n64w4s3 (d=64)
and m128n64w4s3 (d=128) were best on 2-3 of 3 shapes. Later sweeps moved the d<=128 decode entry (below)."""
from __future__ import annotations

from engc.compiler.codegen.tune.table import SM_COUNT, TUNE, put

for _arch in ("sm80", "sm90"):
    _split = dict(target_programs=2 * SM_COUNT[_arch], max_splits=64, min_split_tokens=128,
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
        put(_arch, "paged_attention", "decode", _bucket, BLOCK_N=_block_n, num_warps=4, num_stages=_stages,
             impl="triton", **dict(_split, min_split_tokens=_block_n, min_split_tokens_busy=2 * _block_n),
             in_kernel_reduce=True, rotary_max_rows=32,
             EARLY_KV=_early)
    # decode_reduce: the second launch of the CUDA decode template (the Triton decode reduces in-kernel)
    put(_arch, "paged_attention", "decode_reduce", "any", num_warps=4, num_stages=1)
    # The CUDA C++ twin of the decode kernel (templates/paged_decode.cu.j2): built and launched instead of
    # the Triton one only where the 'decode' entry says impl="cuda" and nvcc was there at build time.
    # BLOCK_N follows from warps and tokens per thread (64 tokens for d<=128, 32 for d=256).
    put(_arch, "paged_attention", "decode_cuda", "d<=64", TOKENS_PER_THREAD=4, num_warps=4, **_split)
    put(_arch, "paged_attention", "decode_cuda", "d<=128", TOKENS_PER_THREAD=8, num_warps=4, **_split)
    put(_arch, "paged_attention", "decode_cuda", "d>128", TOKENS_PER_THREAD=8, num_warps=4, **_split)

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
    put("sm90", "paged_attention", "decode_cluster", _bucket, enabled=True, cluster=8, num_warps=4, stages=1,
         max_seqs=1, max_context=1024)

# smem_carveout 25 for the norms and the decode attention (every decode variant) on sm90. A 10-40% split for
# every kernel took the int4 8B batch-1 step from 1.92 to 1.89 ms but the bf16 8B step from 4.14 to 4.33
# (bench/results/h200_a5e314b_carveout_sweep.json); given to these kernels alone (bench/ab/norms_attn_carveout25.json,
# one lease each, h200_a70445a_carveout_ab.json): int4 + int4 head b1 1.895 ms against 1.920-1.923 (528.7
# against 522.7-523.7 tok/s), b32 5,447 against 5,461; bf16 8B b1 4.077 against 4.093 ms, b32 5,865 against 5,842.
# The Triton decode alone at 100% (twenty-first session, bench/ab/decode_carveout100.json): bf16 8B b32 5,737 against
# 5,786 stock, graph 4.929 against 4.897 ms (bench/results/h200_3511e75_decode_carveout100.json): not taken.
for _key in [k for k in TUNE if k.startswith(("sm90/rms_norm/", "sm90/paged_attention/decode"))]:
    TUNE[_key]["smem_carveout"] = 25
put("sm90", "paged_attention", "prefill", "d<=64", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
put("sm90", "paged_attention", "prefill", "d<=128", BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
put("sm90", "paged_attention", "prefill", "d>128", BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
put("sm80", "paged_attention", "prefill", "d<=64", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
put("sm80", "paged_attention", "prefill", "d<=128", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
put("sm80", "paged_attention", "prefill", "d>128", BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
