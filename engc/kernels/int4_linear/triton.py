"""W4A16 kernels over the engc int4 layout: a GEMV for decode batches, its split-K reduce, and a GEMM.

GEMV (M <= the launch rule's gemv_max_rows): decode is bound by reading the packed weights, so every
weight word is read from DRAM once for all M rows (BLOCK_M is M rounded up to a power of two), and
dequantizing must cost less than the load. Three ALU ops per weight per row, no shifts per nibble:
  * nibble j of a word is masked in place, OR-ed into the mantissa of 2**23 and read as a float:
    2**23 + q * 16**j exactly (j <= 3; nibbles 4..7 come from the word shifted down by 16, one shift
    per word). Subtracting 2**23 leaves q * 16**j; the 16**-j goes into x, exactly (a power of two).
  * the zero point leaves the inner loop: sum_k x_k (q_k - z) = sum_k x_k q_k - z * sum_k x_k, so a
    word row pays one FMA for it; the group scale multiplies once per word row too.
Partial sums stay in a [BLOCK_M, BLOCK_R, BLOCK_N] register tile and are reduced over R once, at the
end. Enough programs for the SMs come from narrow BLOCK_N and, for small N, a split over K whose fp32
partials the reduce kernel sums in a fixed order (deterministic, no atomics).

GEMM (prefill-sized M): tl.dot tiles; BLOCK_K divides the group size (the spec sees to it), so a K tile
has one scale and zero row, loaded as [BLOCK_N] vectors; dequantized in registers to the activation dtype.
N is a multiple of 8 in every AWQ/GPTQ checkpoint (both pack 8 output columns per zero word): the kernels
assume it for 16-byte loads along N.
"""
import triton
import triton.language as tl

MAGIC = tl.constexpr(0x4B000000)   # float 2**23: its 23 mantissa bits hold an integer exactly
MAGIC_F = tl.constexpr(8388608.0)


@triton.jit
def int4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, rows_per_split, has_bias,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < N, offs_m < M
    words_k = K // 8
    r_begin = split * rows_per_split
    r_end = tl.minimum(r_begin + rows_per_split, words_k)
    acc = tl.zeros((BLOCK_M, BLOCK_R, BLOCK_N), dtype=tl.float32)
    for r0 in range(r_begin, r_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask_r = rows < r_end
        mask_w = mask_r[:, None] & mask_n[None, :]
        row_off = tl.multiple_of(rows * N, 8)  # N % 8 == 0: 16-byte loads along N
        words = tl.load(qw_ptr + row_off[:, None] + offs_n[None, :], mask=mask_w, other=0)
        g_off = tl.multiple_of((rows * 8 // GROUP) * N, 8)
        s = tl.load(s_ptr + g_off[:, None] + offs_n[None, :], mask=mask_w, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off[:, None] + offs_n[None, :], mask=mask_w, other=0).to(tl.float32)
        high = words >> 16
        x_base = x_ptr + offs_m[:, None] * K + rows[None, :] * 8
        mask_x = mask_m[:, None] & mask_r[None, :]
        part = tl.zeros((BLOCK_M, BLOCK_R, BLOCK_N), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for j in tl.static_range(8):
            x_j = tl.load(x_base + j, mask=mask_x, other=0.0).to(tl.float32)
            x_sum += x_j
            if j < 4:
                bits = (words & (0xF << (4 * j))) | MAGIC
            else:
                bits = (high & (0xF << (4 * (j - 4)))) | MAGIC
            q_scaled = bits.to(tl.float32, bitcast=True) - MAGIC_F          # q * 16 ** (j % 4)
            x_j = x_j * (1.0 / (1 << (4 * (j % 4))))
            part += x_j[:, :, None] * q_scaled[None, :, :]
        acc += s[None, :, :] * (part - z[None, :, :] * x_sum[:, :, None])
    out = tl.sum(acc, axis=1)
    out_off = offs_m[:, None] * N + offs_n[None, :]
    mask_out = mask_m[:, None] & mask_n[None, :]
    if tl.num_programs(1) == 1:
        if has_bias:
            out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
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
def int4_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, M, N, K, has_bias,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    # grouped tile order: GROUP_M row tiles share each weight column tile while it is in L2
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_row = tl.multiple_of(offs_m.to(tl.int64) * K, 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + x_row[:, None] + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_row = tl.multiple_of((offs_k // 8) * N, 8)
        words = tl.load(qw_ptr + w_row[:, None] + offs_n[None, :], mask=mask_k[:, None] & mask_n[None, :], other=0)
        q = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
        g_off = (k0 // GROUP) * N  # BLOCK_K divides GROUP: one group per K tile
        s = tl.load(s_ptr + g_off + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off + offs_n, mask=mask_n, other=0).to(tl.float32)
        w = (q.to(tl.float32) - z[None, :]) * s[None, :]
        acc = tl.dot(x, w.to(x.dtype), acc)
    if has_bias:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


KERNELS = {"gemv": int4_gemv_kernel, "gemv_reduce": int4_gemv_reduce_kernel, "gemm": int4_gemm_kernel}
JIT_CONSTS = {  # what the JIT path (tests, sweeps) launches with when not told otherwise
    "gemv": dict(BLOCK_N=32, BLOCK_R=16, num_warps=4, target_programs=132, max_splits=16),
    "gemv_reduce": dict(BLOCK=256, num_warps=4),
    "gemm": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4),
}


def int4_linear_triton(x, qweight, scales, zeros, *extra, group_size: int, has_bias: int = 0,
                       act_order: int = 0, consts=None):
    """kernels/int4_linear's launch rule run through Triton's JIT (tests, benchmarks); consts as the
    bundle records hold them ({'gemv_m1_g128': {...}, ...}), else JIT_CONSTS for every variant."""
    import torch
    from engc.kernels import int4_linear as op
    bias = extra[0] if has_bias else None
    if act_order:
        x = x.index_select(-1, extra[int(bool(has_bias))])
    x = x.contiguous()
    y = torch.empty(x.shape[0], qweight.shape[1], dtype=x.dtype, device=x.device)
    if consts is None:
        consts = op.jit_consts(group_size, JIT_CONSTS)
    for variant, grid, args in op.launch(x, qweight, scales, zeros, bias, y, group_size=group_size,
                                         consts=consts):
        kind = op.variant_kind(variant)
        c = consts[variant]
        meta = {k: v for k, v in c.items() if k.isupper()}
        if kind in ("gemv", "gemm"):
            meta["GROUP"] = group_size
        if kind == "gemv":
            meta["BLOCK_M"] = op.variant_rows(variant)
        # null pointers (0) become y: the JIT needs a tensor there, the kernel never touches it
        tensors = [y if (i < op.POINTER_ARGS[kind] and isinstance(a, int)) else a for i, a in enumerate(args[:-2])]
        KERNELS[kind][grid](*tensors, num_warps=c.get("num_warps", 4), **meta)
    return y

