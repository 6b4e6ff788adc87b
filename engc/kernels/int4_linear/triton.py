"""W4A16 kernels over the engc int4 layout (kernels/int4_linear): a GEMV for decode batches, its split-K
reduce, and the dequant kernel that feeds cuBLAS for prefill-sized M.

GEMV: decode is bound by reading the packed weights, so the kernel is shaped like a bf16 GEMV over
[N, K] rows. A program owns BLOCK_N rows; each thread loads whole 16-byte chunks (32 weights of one row,
tile [BLOCK_N, BLOCK_C, 4] words), the next tile's words are loaded before the current one is used (two
tiles in flight per thread), and every weight is read once for all M rows of x. Dequantizing must cost
less than the load, so per weight and row it is one LOP3, one FADD and one FFMA:
  * nibble j of a word is masked in place, OR-ed into the mantissa of 2**23 and read as a float:
    2**23 + q * 16**j exactly (j <= 3; nibbles 4..7 come from the word shifted down by 16, one shift
    per word). Subtracting 2**23 leaves q * 16**j; the 16**-j goes into x, exactly (a power of two).
  * nibble j of the chunk's four words holds inputs 4j..4j+3 of the chunk (the layout's interleave),
    so x for a plane is one 8-byte load per thread, shared by all of the thread's rows.
  * the zero point leaves the inner loop: sum_k x_k (q_k - z) = sum_k x_k q_k - z * sum_k x_k, so the
    group scale and zero cost two FMAs per 32 weights and row.
Partial sums stay per thread and chunk position ([BLOCK_N, BLOCK_C]) and are reduced across threads once,
at the end. Enough programs for the SMs come from narrow BLOCK_N and, for small N, a split over K whose
fp32 partials the reduce kernel sums in a fixed order (deterministic, no atomics).

Dequant: W[n, k] = (q - z) * s in the activation dtype, [N, K] row-major (torch's Linear weight), each
thread reading a 16-byte chunk and writing its 32 weights as 8 runs of 4; the same rounding as the
reference (an exact (q - z) times the scale, rounded once).
"""
import triton
import triton.language as tl

MAGIC = tl.constexpr(0x4B000000)   # float 2**23: its 23 mantissa bits hold an integer exactly
MAGIC_F = tl.constexpr(8388608.0)


@triton.jit
def _row_tile(words, high, x_tile, mask_x, s, z):
    """One row of x against a [BLOCK_N, BLOCK_C, 4]-word tile: [BLOCK_N, BLOCK_C, 1] scaled partial sums.
    x_tile: pointers [1, BLOCK_C, 4] to inputs 4j + i of each chunk for j = 0 (plane j adds 4j). Every
    operand is 3-D with the words' layout, so no value changes threads (no shared-memory round trip)."""
    p = tl.zeros(words.shape, dtype=tl.float32)
    xs = tl.zeros(x_tile.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        if j < 4:
            bits = (words & (0xF << (4 * j))) | MAGIC
        else:
            bits = (high & (0xF << (4 * (j - 4)))) | MAGIC
        q_scaled = bits.to(tl.float32, bitcast=True) - MAGIC_F          # q * 16 ** (j % 4), exact
        x = tl.load(x_tile + 4 * j, mask=mask_x, other=0.0).to(tl.float32)
        xs += x
        p += q_scaled * (x * (1.0 / (1 << (4 * (j % 4)))))
    return s * (tl.sum(p, axis=2, keep_dims=True) - z * tl.sum(xs, axis=2, keep_dims=True))


@triton.jit
def int4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, chunks_per_split, has_bias,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N read row N-1 again (stores are masked): weight loads need no mask along N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_rows = qw_ptr + tl.multiple_of(rows * (K // 8), 4)                 # K % 32 == 0: 16-byte aligned rows
    sz_rows = rows * ((K + GROUP - 1) // GROUP)
    offs_c = tl.arange(0, BLOCK_C)
    offs_i = tl.arange(0, 4)
    w_off = offs_c[None, :, None] * 4 + offs_i[None, None, :]            # [1, BLOCK_C, 4] words of a tile
    x_off = offs_c[None, :, None] * 32 + offs_i[None, None, :]           # input 4j + i of each chunk, j = 0
    c_begin = split * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, K // 32)
    # rows of x past M read nothing: their chunks end where they begin
    end1, end2, end3 = tl.where(M > 1, c_end, 0), tl.where(M > 2, c_end, 0), tl.where(M > 3, c_end, 0)
    end4, end5, end6 = tl.where(M > 4, c_end, 0), tl.where(M > 5, c_end, 0), tl.where(M > 6, c_end, 0)
    end7 = tl.where(M > 7, c_end, 0)
    acc0 = tl.zeros((BLOCK_N, BLOCK_C, 1), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_C, 1), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_C, 1), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_C, 1), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_N, BLOCK_C, 1), dtype=tl.float32)
    acc5 = tl.zeros((BLOCK_N, BLOCK_C, 1), dtype=tl.float32)
    acc6 = tl.zeros((BLOCK_N, BLOCK_C, 1), dtype=tl.float32)
    acc7 = tl.zeros((BLOCK_N, BLOCK_C, 1), dtype=tl.float32)
    words = tl.load(w_rows[:, None, None] + c_begin * 4 + w_off,
                    mask=((c_begin + offs_c) < c_end)[None, :, None], other=0)
    for c0 in range(c_begin, c_end, BLOCK_C):
        mask_c = (c0 + offs_c) < c_end
        # the next tile's words are in flight while this one is dequantized
        nxt = tl.load(w_rows[:, None, None] + (c0 + BLOCK_C) * 4 + w_off,
                      mask=((c0 + BLOCK_C + offs_c) < c_end)[None, :, None], other=0)
        sz_off = sz_rows[:, None, None] + ((c0 + offs_c) * 32 // GROUP)[None, :, None]  # a chunk lies in one group
        s = tl.load(s_ptr + sz_off, mask=mask_c[None, :, None], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + sz_off, mask=mask_c[None, :, None], other=0).to(tl.float32)
        high = words >> 16
        x_tile = x_ptr + c0 * 32 + x_off
        x_row = K // 32 * 32   # = K; written so the compiler knows each row of x starts 64-byte aligned
        mask_x = mask_c[None, :, None]
        acc0 += _row_tile(words, high, x_tile, mask_x, s, z)
        if BLOCK_M > 1:
            acc1 += _row_tile(words, high, x_tile + x_row, (c0 + offs_c)[None, :, None] < end1, s, z)
        if BLOCK_M > 2:
            acc2 += _row_tile(words, high, x_tile + 2 * x_row, (c0 + offs_c)[None, :, None] < end2, s, z)
            acc3 += _row_tile(words, high, x_tile + 3 * x_row, (c0 + offs_c)[None, :, None] < end3, s, z)
        if BLOCK_M > 4:
            acc4 += _row_tile(words, high, x_tile + 4 * x_row, (c0 + offs_c)[None, :, None] < end4, s, z)
            acc5 += _row_tile(words, high, x_tile + 5 * x_row, (c0 + offs_c)[None, :, None] < end5, s, z)
            acc6 += _row_tile(words, high, x_tile + 6 * x_row, (c0 + offs_c)[None, :, None] < end6, s, z)
            acc7 += _row_tile(words, high, x_tile + 7 * x_row, (c0 + offs_c)[None, :, None] < end7, s, z)
        words = nxt
    r = tl.arange(0, BLOCK_M)[:, None]
    out = tl.where(r == 0, tl.sum(tl.sum(acc0, axis=2), axis=1)[None, :], 0.0)
    if BLOCK_M > 1:
        out = tl.where(r == 1, tl.sum(tl.sum(acc1, axis=2), axis=1)[None, :], out)
    if BLOCK_M > 2:
        out = tl.where(r == 2, tl.sum(tl.sum(acc2, axis=2), axis=1)[None, :], out)
        out = tl.where(r == 3, tl.sum(tl.sum(acc3, axis=2), axis=1)[None, :], out)
    if BLOCK_M > 4:
        out = tl.where(r == 4, tl.sum(tl.sum(acc4, axis=2), axis=1)[None, :], out)
        out = tl.where(r == 5, tl.sum(tl.sum(acc5, axis=2), axis=1)[None, :], out)
        out = tl.where(r == 6, tl.sum(tl.sum(acc6, axis=2), axis=1)[None, :], out)
        out = tl.where(r == 7, tl.sum(tl.sum(acc7, axis=2), axis=1)[None, :], out)
    out_off = r * N + offs_n[None, :]
    mask_out = (r < M) & (offs_n[None, :] < N)
    if tl.num_programs(1) == 1:
        if has_bias:
            out += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + out_off, out.to(y_ptr.dtype.element_ty), mask=mask_out)
    else:
        tl.store(part_ptr + split * M * N + out_off, out, mask=mask_out)


@triton.jit
def int4_gemv_reduce_kernel(part_ptr, bias_ptr, y_ptr, M, N, num_splits, has_bias, BLOCK: tl.constexpr):
    """y[m, n] = sum over splits of part[s, m, n] (+ bias), in split order: the same bits every run."""
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=mask, other=0.0)
    if has_bias:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * N + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def int4_dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K,
                        GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    chunks = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_i = tl.arange(0, 4)
    rows = offs_n.to(tl.int64)
    mask2 = (offs_n < N)[:, None] & (chunks < K // 32)[None, :]
    mask3 = mask2[:, :, None]
    w_in = qw_ptr + tl.multiple_of(rows * (K // 8), 4)
    words = tl.load(w_in[:, None, None] + (chunks * 4)[None, :, None] + offs_i[None, None, :], mask=mask3, other=0)
    sz_off = rows[:, None] * ((K + GROUP - 1) // GROUP) + (chunks * 32 // GROUP)[None, :]
    s = tl.load(s_ptr + sz_off, mask=mask2, other=0.0).to(tl.float32)[:, :, None]
    z_magic = tl.load(z_ptr + sz_off, mask=mask2, other=0).to(tl.float32)[:, :, None] + MAGIC_F
    w_out = (w_ptr + tl.multiple_of(rows * K, 32))[:, None, None] + (chunks * 32)[None, :, None] + offs_i[None, None, :]
    for j in tl.static_range(8):
        bits = ((words >> (4 * j)) & 0xF) | MAGIC
        w = (bits.to(tl.float32, bitcast=True) - z_magic) * s        # (q - z) exactly, times the scale
        tl.store(w_out + 4 * j, w.to(w_ptr.dtype.element_ty), mask=mask3)


KERNELS = {"gemv": int4_gemv_kernel, "gemv_reduce": int4_gemv_reduce_kernel, "dequant": int4_dequant_kernel}
JIT_CONSTS = {  # what the JIT path (tests, sweeps) launches with when not told otherwise
    "gemv": dict(BLOCK_N=16, BLOCK_C=32, num_warps=4, gemv_max_rows=8, target_programs=132, max_splits=16),
    "gemv_reduce": dict(BLOCK=256, num_warps=4),
    "dequant": dict(BLOCK_N=16, BLOCK_C=8, num_warps=4),
}


def int4_linear_triton(x, qweight, scales, zeros, *extra, group_size: int, has_bias: int = 0,
                       act_order: int = 0, consts=None):
    """kernels/int4_linear's launch rule run through Triton's JIT (tests, benchmarks); consts as the
    bundle records hold them ({'gemv_m1_g128': {...}, ...}), else JIT_CONSTS for every variant."""
    from engc.kernels import int4_linear as op
    bias = extra[0] if has_bias else None
    if act_order:
        x = x.index_select(-1, extra[int(bool(has_bias))])
    if consts is None:
        consts = op.jit_consts(group_size, JIT_CONSTS)
    return op.run_quantized_linear(x.contiguous(), qweight, scales, zeros, bias, group_size=group_size,
                                   consts=consts, run=lambda launches: jit_run(launches, consts, group_size))


def jit_run(launches, consts: dict, group_size: int) -> None:
    """Runs the launch rule's [(variant, grid, args)] through Triton's JIT, as a bundle's cubins would run."""
    from engc.kernels import int4_linear as op
    for variant, grid, args in launches:
        kind = op.variant_kind(variant)
        c = consts[variant]
        meta = {k: v for k, v in c.items() if k.isupper()}
        if kind in ("gemv", "dequant"):
            meta["GROUP"] = group_size
        if kind == "gemv":
            meta["BLOCK_M"] = op.variant_rows(variant)
        # null pointers (0) become the first tensor: the JIT needs a tensor there, the kernel never reads it
        tensors = [args[0] if (i < op.POINTER_ARGS[kind] and isinstance(a, int)) else a
                   for i, a in enumerate(args[:-2])]
        KERNELS[kind][grid](*tensors, num_warps=c.get("num_warps", 4), **meta)
