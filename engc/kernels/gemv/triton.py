"""Decode GEMV: y[M, N] = act(x)[M, K] @ W[N, K]^T for a few rows M; grid (cdiv(N, BLOCK_N), splits).

Each program owns BLOCK_N rows of W and one K range (a split); it reads that slice of W from DRAM once,
for all M rows of x, in BLOCK_K-wide contiguous loads. Small M (BLOCK_M <= 4 or so) multiplies on the
CUDA cores (DOT=False: a row of x times the W tile, reduced along K; rows past M are skipped at run
time); larger M pads to BLOCK_M >= 16 and uses tl.dot (tensor cores), whose W tiles Triton pipelines
through shared memory over num_stages.

Split-K for parallelism when N alone gives too few programs, reduced in the same launch by the last
split to arrive (kernels/gemm_tiles.py: fp32 partials, summed in split order, counters left zeroed), so
one launch does the job of cuBLAS's GEMV + splitK-reduce pair.

SILU: x is the fused gate_up [M, 2K] (gate first) and the kernel multiplies by silu(gate) * up, rounded
to the storage dtype at the same two points as kernels/silu_mul does, so results match silu_mul + linear.
"""
import triton
import triton.language as tl

from engc.kernels import gemm_tiles, pdl

# K elements per thread and load: 16 bytes of bf16/fp16
VEC: tl.constexpr = tl.constexpr(8)


@triton.jit
def _row_partial(w, x_ptr, m: tl.constexpr, offs_k, k_mask, K: tl.constexpr, SILU: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """W tile times row m of x, summed over each thread's VEC contiguous K elements only: [BLOCK_N,
    BLOCK_K // VEC]. The [1, BLOCK_K] row load gets the W tile's own layout when BLOCK_K is a multiple of
    VEC * 32 * num_warps, so no layout conversion runs in the loop; the cross-thread sum waits until
    the end."""
    x = gemm_tiles.act_tile(x_ptr + m * (2 * K if SILU else K), tl.arange(0, 1), offs_k, tl.arange(0, 1) < 1,
                            k_mask, K, SILU)
    prod = w.to(tl.float32) * x.to(tl.float32)
    return tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // VEC, VEC]), axis=2)


@triton.jit
def _tile(w, x_ptr, rows, offs_k, k_mask, M, acc, acc0, acc1, acc2, acc3, K: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU: tl.constexpr, DOT: tl.constexpr, VEC: tl.constexpr):
    """One W tile into the accumulators: acc (DOT), or acc0..acc3, one per row of x (not DOT)."""
    if DOT:
        x = gemm_tiles.act_tile(x_ptr, rows, offs_k, rows < M, k_mask, K, SILU)
        acc = tl.dot(x.to(w.dtype), tl.trans(w), acc)
    else:
        acc0 += _row_partial(w, x_ptr, 0, offs_k, k_mask, K, SILU, BLOCK_N, BLOCK_K, VEC)
        if BLOCK_M > 1:
            if M > 1:
                acc1 += _row_partial(w, x_ptr, 1, offs_k, k_mask, K, SILU, BLOCK_N, BLOCK_K, VEC)
        if BLOCK_M > 2:
            if M > 2:
                acc2 += _row_partial(w, x_ptr, 2, offs_k, k_mask, K, SILU, BLOCK_N, BLOCK_K, VEC)
        if BLOCK_M > 3:
            if M > 3:
                acc3 += _row_partial(w, x_ptr, 3, offs_k, k_mask, K, SILU, BLOCK_N, BLOCK_K, VEC)
    return acc, acc0, acc1, acc2, acc3


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, partial_ptr, counter_ptr, M, N, k_tiles_per_split, splits,
                K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SILU: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, w_rows = gemm_tiles.w_tile_rows(w_ptr, pid_n, N, K, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    t_begin, t_end = gemm_tiles.split_tiles(pid_k, k_tiles_per_split, K, BLOCK_K)
    # x, the partials and the counters belong to the step: wait for the kernel before
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # not DOT: per row of x, per thread partial sums; reduced across threads once, after the loop
    acc0 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    for t in range(t_begin, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = gemm_tiles.load_w_tile(w_rows, offs_k, k_mask, K, BLOCK_K)
        acc, acc0, acc1, acc2, acc3 = _tile(w, x_ptr, rows, offs_k, k_mask, M, acc, acc0, acc1, acc2, acc3, K,
                                            BLOCK_M, BLOCK_N, BLOCK_K, SILU, DOT, VEC)
    if not DOT:
        r = rows[:, None]
        acc = tl.where(r == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
        acc = tl.where(r == 1, tl.sum(acc1, axis=1)[None, :], acc)
        acc = tl.where(r == 2, tl.sum(acc2, axis=1)[None, :], acc)
        acc = tl.where(r == 3, tl.sum(acc3, axis=1)[None, :], acc)

    out_offs = rows[:, None] * N + offs_n[None, :]
    out_mask = (rows[:, None] < M) & (offs_n[None, :] < N)
    gemm_tiles.store_split_k(acc, out_ptr, partial_ptr, counter_ptr, pid_n, pid_k, M, N, out_offs, out_mask, splits)
