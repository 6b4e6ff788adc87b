"""Per-row float8 quantization inside a Triton kernel, shared by the kernels that write an FP8 GEMM's input:
fp8_quant_kernel and rms_norm_kernel's FP8_OUT variants (passes/fuse_fp8_input_quant), so their codes and
scales are the same bits. Arithmetic as the reference (kernels/fp8_quant.quantize_rows): the scale is the
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
