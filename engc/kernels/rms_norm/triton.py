"""RMSNorm and fused residual-add + RMSNorm: one program per row, the whole row in registers.

Residual: the sum x + residual is written to residual_out, which may be the residual buffer itself (in
place: each program reads its row completely before it writes it) or a separate buffer.
Rounding follows the torch reference: the sum is rounded to the storage dtype before it is normalized,
the normalized value is rounded before the weight multiply.
PARTIALS: x is a split-K GEMV's unreduced output, fp32 [splits, rows, HIDDEN], splits <= MAX_SPLITS
(kernels/int4_linear's cuda_launch with partials): summed in split order and rounded to the dtype, as that
GEMV's own last split would have written it, so the result is the same bits; the GEMV then skips its fence,
ticket and re-read.
FP8_OUT: the output is quantized for the FP8 GEMM after the norm (passes/fuse_fp8_input_quant): each row
rounded to the storage dtype as before, then to float8_e4m3fn with its own scale (row absmax / FP8_MAX, to
scale_ptr), by kernels/fp8_rows.py as fp8_quant_kernel, so the bits are what the norm then fp8_quant would give.
UNIT_OFFSET: Gemma's norm, the row times (1 + weight) in float32 and rounded once (its half-precision bundles;
a float32 bundle folds the 1 into the weight).
"""
import triton
import triton.language as tl

from engc.kernels import fp8_rows, pdl


@triton.jit
def rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps, splits, scale_ptr,
                    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PARTIALS: tl.constexpr,
                    MAX_SPLITS: tl.constexpr, FP8_OUT: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
                    UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr):
    # the storage dtype every intermediate is rounded to: out's, unless out holds float8 codes (then the
    # residual's, which the plain norm variant points at x)
    dt = residual_ptr.dtype.element_ty if FP8_OUT else out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)   # a constant: before the wait
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    if PARTIALS:
        # unrolled to MAX_SPLITS, the absent splits' loads masked off: every load is issued before the first
        # add (a loop to `splits` waited out one round trip a split), and adding their zeros to a sum that
        # started at +0 changes no bit
        total = tl.zeros([BLOCK], dtype=tl.float32)
        plane = tl.num_programs(0).to(tl.int64) * HIDDEN
        for s in tl.static_range(MAX_SPLITS):
            live = mask & (offs * 0 + s < splits)
            total += tl.load(x_ptr + s * plane + row * HIDDEN + offs, mask=live, other=0.0)
        x = total.to(dt)
    else:
        x = tl.load(x_ptr + row * HIDDEN + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * HIDDEN + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(residual_out_ptr + row * HIDDEN + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / HIDDEN
    rstd = 1.0 / tl.sqrt(var + eps)
    if UNIT_OFFSET:   # Gemma's (1 + weight), in float32 before the one rounding, as HF computes it
        y = (xf * rstd * (w + 1.0)).to(dt)
    else:
        y = (w * (xf * rstd).to(dt).to(tl.float32)).to(dt)
    if FP8_OUT:
        q, scale = fp8_rows.quantize_row(y.to(tl.float32), FP8_MAX, MIN_AMAX)
        tl.store(out_ptr + row * HIDDEN + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * HIDDEN + offs, y, mask=mask)
