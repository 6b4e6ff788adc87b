"""W4A16 GEMM (prefill-sized M) and GEMV (decode, M <= GEMV_MAX_ROWS) over the engc int4 layout.

Both dequantize in registers: each weight row k reads its packed word qweight[k // 8, n] and shifts
out nibble k % 8; scale and zero come from row k // GROUP of scales/zeros. Accumulation is float32.
The GEMM tiles M x N with tl.dot; the GEMV gives each program one activation row and BLOCK_N outputs
(a decode batch is a handful of rows, so dequantizing per row costs L2 reads, not DRAM traffic).
"""
import triton
import triton.language as tl


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, offs_k, offs_n, mask_k, mask_n, N, GROUP: tl.constexpr):
    mask = mask_k[:, None] & mask_n[None, :]
    words = tl.load(qw_ptr + (offs_k[:, None] // 8) * N + offs_n[None, :], mask=mask, other=0)
    q = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
    g = (offs_k[:, None] // GROUP) * N + offs_n[None, :]
    s = tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g, mask=mask, other=0).to(tl.int32)
    return (q - z).to(tl.float32) * s


@triton.jit
def int4_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, M, N, K,
                     GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // n_tiles, pid % n_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, offs_k, offs_n, mask_k, mask_n, N, GROUP)
        acc = tl.dot(x, w.to(x.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def int4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, N, K,
                     GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    pid_n, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, offs_k, offs_n, mask_k, mask_n, N, GROUP)
        acc += tl.sum(x[:, None] * w, axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


def int4_linear_triton(x, qweight, scales, zeros, *extra, group_size: int, has_bias: int = 0,
                       act_order: int = 0, block_m: int = 16, block_n: int = 64, block_k: int = 32):
    """The launch rule of kernels/int4_linear, as the JIT path (tests, benchmarks) runs it."""
    import torch
    from engc.kernels.int4_linear import GEMV_MAX_ROWS
    bias = extra[0] if has_bias else None
    if act_order:
        x = x.index_select(-1, extra[int(bool(has_bias))])
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    b = bias if bias is not None else y
    if m <= GEMV_MAX_ROWS:
        int4_gemv_kernel[(triton.cdiv(n, block_n), m)](
            x, qweight, scales, zeros, b, y, n, k, GROUP=group_size, HAS_BIAS=bias is not None,
            BLOCK_N=block_n, BLOCK_K=block_k)
    else:
        int4_gemm_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)](
            x, qweight, scales, zeros, b, y, m, n, k, GROUP=group_size, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
