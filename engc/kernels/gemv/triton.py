"""Decode GEMV: y[M, N] = act(x)[M, K] @ W[N, K]^T for a few rows M; grid (cdiv(N, BLOCK_N), splits).

Each program owns BLOCK_N rows of W and one K range (a split); it reads that slice of W from DRAM once,
for all M rows of x, in BLOCK_K-wide contiguous loads. Small M (BLOCK_M <= 4 or so) multiplies on the
CUDA cores (DOT=False: a row of x times the W tile, reduced along K; rows past M are skipped at run
time); larger M pads to BLOCK_M >= 16 and uses tl.dot (tensor cores), whose W tiles Triton pipelines
through shared memory over num_stages.

Split-K for parallelism when N alone gives too few programs: every split stores its fp32 partial
[M, BLOCK_N] to partial_ptr[split], then counts itself in counter_ptr[pid_n]; the last one to arrive
sums the partials in split order (deterministic), writes y and zeroes the counter for the next launch,
so one launch does the job of cuBLAS's GEMV + splitK-reduce pair. Counters start zeroed (the runtime
owns them) and are left zeroed.

SILU: x is the fused gate_up [M, 2K] (gate first) and the kernel multiplies by silu(gate) * up, rounded
to the storage dtype at the same two points as kernels/silu_mul does, so results match silu_mul + linear.

NORM: the GEMV of AddRMSNormLinear, y = rms_norm(x + residual) @ W^T, which saves the add_rms_norm launch
before every qkv and gate_up projection of a decode step. The tile's input is s = x + residual (rounded as
the residual stream is), times the norm weight; 1 / rms(s) is one number per row, so it multiplies the
dot products at the end instead of every element first: no program waits for the whole row before its
W loads start. Each program sums s^2 over its own K range (the W tile's inputs anyway); a program that
covers all of K has its row's rms at the end, split programs store the sum beside their partials and the
last to arrive adds them. The programs of N tile 0 write s to residual_out (their K ranges cover the row).
Rounding differs from add_rms_norm + GEMV only in that the normalized row is not rounded to the storage
dtype before the multiply. With NORM off its four parameters are compiled out (constexpr None).
"""
import triton
import triton.language as tl

from engc.kernels import pdl

# K elements per thread and load: 16 bytes of bf16/fp16
VEC: tl.constexpr = tl.constexpr(8)


@triton.jit
def _act_tile(x_ptr, res_ptr, rows, offs_k, row_mask, k_mask, K: tl.constexpr, SILU: tl.constexpr,
              NORM: tl.constexpr):
    """[len(rows), BLOCK_K] of the GEMV's input in the storage dtype: silu(gate) * up when SILU, the new
    residual stream x + residual when NORM (its norm weight and 1 / rms are applied by the caller)."""
    stride: tl.constexpr = 2 * K if SILU else K
    ptrs = x_ptr + rows[:, None] * stride + offs_k[None, :]
    mask = row_mask[:, None] & k_mask[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    if SILU:
        g = x.to(tl.float32)
        u = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
        x = (s * u).to(x.dtype)
    if NORM:
        r = tl.load(res_ptr + rows[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _normed(x, rows, offs_k, row_mask, k_mask, norm_w_ptr, res_out_ptr, res_cols, K: tl.constexpr,
            NORM: tl.constexpr):
    """(the tile as fp32 times the norm weight, its squares) for NORM, after writing x + residual to the
    first res_cols columns of residual_out; (the tile as fp32, unused) otherwise."""
    xf = x.to(tl.float32)
    if NORM:
        tl.store(res_out_ptr + rows[:, None] * K + offs_k[None, :], x,
                 mask=row_mask[:, None] & (offs_k < res_cols)[None, :])
        g = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        return xf * g[None, :], xf * xf
    return xf, xf


@triton.jit
def _row_partial(w, x_ptr, res_ptr, norm_w_ptr, res_out_ptr, res_cols, m: tl.constexpr, offs_k, k_mask,
                 K: tl.constexpr, SILU: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """(W tile times row m of the input, summed over each thread's VEC contiguous K elements only:
    [BLOCK_N, BLOCK_K // VEC]; the row's squares [1, BLOCK_K] when NORM). The [1, BLOCK_K] row load gets
    the W tile's own layout when BLOCK_K is a multiple of VEC * 32 * num_warps, so no layout conversion
    runs in the loop; the cross-thread sums wait until the end."""
    row = tl.arange(0, 1) + m
    x = _act_tile(x_ptr, res_ptr, row, offs_k, row >= 0, k_mask, K, SILU, NORM)
    a, sq = _normed(x, row, offs_k, row >= 0, k_mask, norm_w_ptr, res_out_ptr, res_cols, K, NORM)
    prod = w.to(tl.float32) * a
    return tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // VEC, VEC]), axis=2), sq


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, partial_ptr, counter_ptr, M, N, k_tiles_per_split, splits,
                res_ptr, norm_w_ptr, res_out_ptr, eps,
                K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SILU: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N read row N-1 again (stores are masked): W loads need no mask along N and stay wide.
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * K
    rows = tl.arange(0, BLOCK_M)
    k_tiles: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    t_begin = pid_k * k_tiles_per_split
    t_end = tl.minimum(t_begin + k_tiles_per_split, k_tiles)
    # NORM: N tile 0's programs write x + residual (their K ranges cover the row): K columns there, else 0
    res_cols = K * (pid_n == 0).to(tl.int32)
    # x, the partials and the counters belong to the step: wait for the kernel before
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    else:  # per row of x, per thread partial sums; reduced across threads once, after the loop
        acc0 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
        sq0 = tl.zeros([1, BLOCK_K], dtype=tl.float32)   # NORM: each row's squares, per element
        sq1 = tl.zeros([1, BLOCK_K], dtype=tl.float32)
        sq2 = tl.zeros([1, BLOCK_K], dtype=tl.float32)
        sq3 = tl.zeros([1, BLOCK_K], dtype=tl.float32)
    for t in range(t_begin, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if K % BLOCK_K == 0:
            w = tl.load(w_rows + offs_k[None, :])
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
        if DOT:
            x = _act_tile(x_ptr, res_ptr, rows, offs_k, rows < M, k_mask, K, SILU, NORM)
            a, sq_t = _normed(x, rows, offs_k, rows < M, k_mask, norm_w_ptr, res_out_ptr, res_cols, K, NORM)
            if NORM:
                sq += sq_t
            acc = tl.dot(a.to(w.dtype), tl.trans(w), acc)
        else:
            p, sq_t = _row_partial(w, x_ptr, res_ptr, norm_w_ptr, res_out_ptr, res_cols, 0, offs_k, k_mask,
                                   K, SILU, NORM, BLOCK_N, BLOCK_K, VEC)
            acc0 += p
            if NORM:
                sq0 += sq_t
            if BLOCK_M > 1:
                if M > 1:
                    p, sq_t = _row_partial(w, x_ptr, res_ptr, norm_w_ptr, res_out_ptr, res_cols, 1, offs_k,
                                           k_mask, K, SILU, NORM, BLOCK_N, BLOCK_K, VEC)
                    acc1 += p
                    if NORM:
                        sq1 += sq_t
            if BLOCK_M > 2:
                if M > 2:
                    p, sq_t = _row_partial(w, x_ptr, res_ptr, norm_w_ptr, res_out_ptr, res_cols, 2, offs_k,
                                           k_mask, K, SILU, NORM, BLOCK_N, BLOCK_K, VEC)
                    acc2 += p
                    if NORM:
                        sq2 += sq_t
            if BLOCK_M > 3:
                if M > 3:
                    p, sq_t = _row_partial(w, x_ptr, res_ptr, norm_w_ptr, res_out_ptr, res_cols, 3, offs_k,
                                           k_mask, K, SILU, NORM, BLOCK_N, BLOCK_K, VEC)
                    acc3 += p
                    if NORM:
                        sq3 += sq_t
    if DOT:
        ss = tl.sum(sq, axis=1)
    else:
        r = rows[:, None]
        acc = tl.where(r == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
        acc = tl.where(r == 1, tl.sum(acc1, axis=1)[None, :], acc)
        acc = tl.where(r == 2, tl.sum(acc2, axis=1)[None, :], acc)
        acc = tl.where(r == 3, tl.sum(acc3, axis=1)[None, :], acc)
        ss = tl.where(rows == 0, tl.sum(sq0), 0.0)
        ss = tl.where(rows == 1, tl.sum(sq1), ss)
        ss = tl.where(rows == 2, tl.sum(sq2), ss)
        ss = tl.where(rows == 3, tl.sum(sq3), ss)

    out_offs = rows[:, None] * N + offs_n[None, :]
    out_mask = (rows[:, None] < M) & (offs_n[None, :] < N)
    if splits == 1:
        if NORM:
            acc = acc * (1.0 / tl.sqrt(ss / K + eps))[:, None]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(partial_ptr + pid_k * M * N + out_offs, acc, mask=out_mask)
        if NORM:   # this split's sums of squares, after every split's [M, N] partials (same from every N tile)
            tl.store(partial_ptr + splits * M * N + pid_k * M + rows, ss, mask=rows < M)
        tl.debug_barrier()  # every thread's partial is stored before this program counts as arrived
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in range(0, splits):
                total += tl.load(partial_ptr + s * M * N + out_offs, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
                if NORM:
                    ss += tl.load(partial_ptr + splits * M * N + s * M + rows, mask=rows < M, other=0.0,
                                  cache_modifier=".cg")
            if NORM:
                total = total * (1.0 / tl.sqrt(ss / K + eps))[:, None]
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")
