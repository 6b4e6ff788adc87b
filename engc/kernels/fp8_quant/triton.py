"""Per-token dynamic FP8 quantization: x [M, K] -> x_fp8 [M, K] e4m3 and scale [M] = row absmax / 448.

One program per row, the whole row (BLOCK = next power of two of K) in registers; K is a constexpr so
the loads vectorize. Arithmetic as the reference (kernels/fp8_quant; in kernels/fp8_rows.py): divisions correctly rounded
(Triton's plain '/' is div.full, off by up to 2 ulp), x / scale clamped to +-448, then rounded to
nearest-even by the float8 conversion (cvt.rn.satfinite), so GPU and reference agree bit for bit.
SILU: x is a fused gate_up [M, 2K] and the row quantized is silu(gate) * up, rounded as kernels/silu_mul
rounds it to x's dtype (the down projection's input of an fp8 bundle: passes/fuse_fp8_input_quant, one
launch where silu_mul and fp8_quant were two).
"""
import triton
import triton.language as tl

from engc.kernels import fp8_rows, pdl
from engc.kernels.silu_rows import silu_times_up


@triton.jit
def fp8_quant_kernel(x_ptr, out_ptr, scale_ptr, K: tl.constexpr, BLOCK: tl.constexpr,
                     FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)   # PDL (kernels/pdl.py): x is the step's; the tune entry's PDL (on)
    pdl.launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    if SILU:
        dt = x_ptr.dtype.element_ty
        g = tl.load(x_ptr + row * (2 * K) + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * (2 * K) + K + offs, mask=mask, other=0.0).to(tl.float32)
        x = silu_times_up(g, u, dt).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
    q, scale = fp8_rows.quantize_row(x, FP8_MAX, MIN_AMAX)
    tl.store(out_ptr + row * K + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)
