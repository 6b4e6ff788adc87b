"""Gemma's RMSNorm, (1 + weight) applied in float32 before the one rounding: the residual-add norm of a row,
and the per-head norm of a token's q and k heads (the v heads copied or left in place), one program a row.
The residual sum is rounded to the storage dtype before it is normalized, as the torch reference does.
"""
import triton
import triton.language as tl

from engc.kernels import pdl


@triton.jit
def rms_norm_unit_offset_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
                                HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                                PDL: tl.constexpr):
    dt = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32) + 1.0   # a constant: before the wait
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    x = tl.load(x_ptr + row * HIDDEN + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * HIDDEN + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(residual_out_ptr + row * HIDDEN + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / HIDDEN + eps)
    tl.store(out_ptr + row * HIDDEN + offs, (xf * rstd * w).to(dt), mask=mask)


@triton.jit
def _norm_heads(src, dst, w_ptr, eps, N_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                D_PAD: tl.constexpr):
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < N_HEADS) & (d < HEAD_DIM)
    xf = tl.load(src + h * HEAD_DIM + d, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)
    w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32) + 1.0
    tl.store(dst + h * HEAD_DIM + d, (xf * rstd[:, None] * w).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def qk_norm_unit_offset_kernel(qkv_ptr, q_weight_ptr, k_weight_ptr, out_ptr, eps, copy_v,
                               NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               H_PAD: tl.constexpr, KV_PAD: tl.constexpr, D_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    ROW: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    Q_SIZE: tl.constexpr = NUM_HEADS * HEAD_DIM
    KV_SIZE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    t = tl.program_id(0).to(tl.int64)
    src = qkv_ptr + t * ROW
    dst = out_ptr + t * ROW
    _norm_heads(src, dst, q_weight_ptr, eps, NUM_HEADS, H_PAD, HEAD_DIM, D_PAD)
    _norm_heads(src + Q_SIZE, dst + Q_SIZE, k_weight_ptr, eps, NUM_KV_HEADS, KV_PAD, HEAD_DIM, D_PAD)
    if copy_v != 0:
        h = tl.arange(0, KV_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        v = tl.load(src + Q_SIZE + KV_SIZE + h * HEAD_DIM + d, mask=mask)
        tl.store(dst + Q_SIZE + KV_SIZE + h * HEAD_DIM + d, v, mask=mask)
