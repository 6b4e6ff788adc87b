"""Per-row float8 quantization inside a Triton kernel, shared by the kernels that write an FP8 GEMM's input
(fp8_quant_kernel and rms_norm_kernel's FP8_OUT variants, passes/fuse_fp8_input_quant) and the GEMMs that
quantize their own input (fp8_linear's QUANT_X, the MoE experts' FP8_W), so their codes and scales are the
same bits. Arithmetic as the reference (kernels/fp8_quant.quantize_rows): the scale is the
row's absmax / FP8_MAX (floored at MIN_AMAX / FP8_MAX), divisions correctly rounded (Triton's plain '/' is
div.full), x / scale clamped to +-FP8_MAX; the caller's cast to float8 rounds to nearest even.
"""
import triton
import triton.language as tl


@triton.jit
def quantize_row(x, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    """x: one row, float32 [BLOCK] (masked lanes 0) -> (x / scale clamped, still float32; scale)."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX), FP8_MAX)
    return tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX), scale


@triton.jit
def row_scales(x_ptr, rows, row_mask, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    """The scales of BLOCK_M rows of a row-major [*, K] tensor (rows: their indices, any integer type): each
    row's absmax / FP8_MAX as quantize_row takes it, read BLOCK_K columns at a time (a GEMM's own pass over
    its input, ahead of its K loop)."""
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=row_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX)


@triton.jit
def quantize_tile(x, scale, FP8_MAX: tl.constexpr):
    """x [M, K] (any float dtype) / its rows' scales [M], clamped, as float8 e4m3 codes (the cast rounds to
    nearest even)."""
    q = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale[:, None]), -FP8_MAX, FP8_MAX)
    return q.to(tl.float8e4nv)
