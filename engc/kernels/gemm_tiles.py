"""@triton.jit pieces the decode GEMM kernels share (kernels/gemv, skinny_gemm, fp8_linear triton.py): the
program's W rows and their K-tile loads, its split's K range, the (SiLU-fused) input tile, and the split-K
epilogue.

Split-K reduced in the same launch: every split stores its fp32 partial tile to partial_ptr[split], then
counts itself in counter_ptr[pid_n]; the last one to arrive sums the partials in split order (so the
result does not depend on which split finished when), writes the output and zeroes the counter for the
next launch. Counters start zeroed (the runtime owns them) and are left zeroed. `offs`/`mask` address
one [M, N] output tile in whatever layout the kernel's accumulator has ([BLOCK_M, BLOCK_N] for the GEMV,
transposed [BLOCK_N, BLOCK_M] for the swap-AB kernels); the partials use the same offsets.

Triton inlines these into each kernel, so the compiled code is what it was when they were written out in
every kernel (the cubins were compared byte for byte when they moved here).
"""
import triton
import triton.language as tl

from engc.kernels.silu_rows import silu_times_up


@triton.jit
def w_tile_rows(w_ptr, pid_n, N, K: tl.constexpr, BLOCK_N: tl.constexpr):
    """offs_n and the row pointers of program pid_n's BLOCK_N rows of W [N, K]. Rows past N read row N-1
    again (stores are masked): W loads need no mask along N and stay wide."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * K
    return offs_n, w_rows


@triton.jit
def split_tiles(pid_k, k_tiles_per_split, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(t_begin, t_end): the K tiles split pid_k sums over; the last split may be short."""
    k_tiles: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    t_begin = pid_k * k_tiles_per_split
    t_end = tl.minimum(t_begin + k_tiles_per_split, k_tiles)
    return t_begin, t_end


@triton.jit
def load_w_tile(w_rows, offs_k, k_mask, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """W [BLOCK_N, BLOCK_K] at columns offs_k; unmasked, so wide, where K is a multiple of BLOCK_K."""
    if K % BLOCK_K == 0:
        w = tl.load(w_rows + offs_k[None, :])
    else:
        w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
    return w


@triton.jit
def act_tile(x_ptr, rows, offs_k, row_mask, k_mask, K: tl.constexpr, SILU: tl.constexpr):
    """[len(rows), BLOCK_K] of the GEMM's input in its storage dtype; silu(gate) * up when SILU (x is then
    the fused gate_up [M, 2K], gate first), rounded to the storage dtype at the same two points as
    kernels/silu_mul does, so results match silu_mul + linear."""
    stride: tl.constexpr = 2 * K if SILU else K
    ptrs = x_ptr + rows[:, None] * stride + offs_k[None, :]
    mask = row_mask[:, None] & k_mask[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    if SILU:
        g = x.to(tl.float32)
        u = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        x = silu_times_up(g, u, x.dtype)
    return x


@triton.jit
def store_partial_and_arrive(acc, partial_ptr, counter_ptr, pid_n, pid_k, M, N, offs, mask, splits):
    """Store this split's fp32 partial and count it in its N tile's counter; true in the last to arrive."""
    tl.store(partial_ptr + pid_k * M * N + offs, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is stored before this program counts as arrived
    arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    return arrived == splits - 1


@triton.jit
def sum_partials(partial_ptr, M, N, offs, mask, splits):
    """The splits' partials summed in split order (fp32, the shape of offs); .cg: read them from L2, where
    the other programs' stores are, not from a stale L1 line."""
    total = tl.zeros(offs.shape, dtype=tl.float32)
    for s in range(0, splits):
        total += tl.load(partial_ptr + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def reset_counter(counter_ptr, pid_n):
    """Zero the N tile's counter for the next launch (by the last program to arrive, after its store)."""
    tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def store_split_k(acc, out_ptr, partial_ptr, counter_ptr, pid_n, pid_k, M, N, offs, mask, splits):
    """The epilogue of a kernel whose output is acc cast to out's dtype: stored directly when K is not
    split, else through the partials, the last split to arrive storing the sum."""
    if splits == 1:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        if store_partial_and_arrive(acc, partial_ptr, counter_ptr, pid_n, pid_k, M, N, offs, mask, splits):
            total = sum_partials(partial_ptr, M, N, offs, mask, splits)
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            reset_counter(counter_ptr, pid_n)
