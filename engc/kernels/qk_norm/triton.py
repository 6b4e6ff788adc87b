"""RMSNorm of q and k inside the fused qkv row, one program per token: per head (Qwen3; Gemma's (1 + weight)
with UNIT_OFFSET), or with PROJECTION each of q and k as one vector over all its heads (OLMoE).

out may be qkv itself (in place: the launch rule then sets copy_v = 0 and v is left where it is) or a
separate [T, q + 2kv] buffer (copy_v = 1 copies the v heads across).
"""
import triton
import triton.language as tl

from engc.kernels import pdl


@triton.jit
def _norm_heads(src, dst, w_ptr, eps, N_HEADS: tl.constexpr, H_PAD: tl.constexpr,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < N_HEADS) & (d < HEAD_DIM)
    x = tl.load(src + h * HEAD_DIM + d, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / HEAD_DIM
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    if UNIT_OFFSET:   # Gemma's (1 + weight), in float32 before the one rounding, as HF computes it
        y = xf * rstd[:, None] * (w + 1.0)
    else:
        y = w * (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
    tl.store(dst + h * HEAD_DIM + d, y.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def qk_norm_kernel(qkv_ptr, q_weight_ptr, k_weight_ptr, out_ptr, eps, copy_v,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   H_PAD: tl.constexpr, KV_PAD: tl.constexpr, D_PAD: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                   PROJECTION: tl.constexpr, Q_PAD: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    ROW: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    Q_SIZE: tl.constexpr = NUM_HEADS * HEAD_DIM
    KV_SIZE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    t = tl.program_id(0).to(tl.int64)
    src = qkv_ptr + t * ROW
    dst = out_ptr + t * ROW
    if PROJECTION:   # q and k each one "head" as wide as the projection, with a weight as wide
        _norm_heads(src, dst, q_weight_ptr, eps, 1, 1, Q_SIZE, Q_PAD, UNIT_OFFSET)
        _norm_heads(src + Q_SIZE, dst + Q_SIZE, k_weight_ptr, eps, 1, 1, KV_SIZE, K_PAD, UNIT_OFFSET)
    else:
        _norm_heads(src, dst, q_weight_ptr, eps, NUM_HEADS, H_PAD, HEAD_DIM, D_PAD, UNIT_OFFSET)
        _norm_heads(src + Q_SIZE, dst + Q_SIZE, k_weight_ptr, eps, NUM_KV_HEADS, KV_PAD, HEAD_DIM, D_PAD,
                    UNIT_OFFSET)
    if copy_v != 0:
        h = tl.arange(0, KV_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        v = tl.load(src + Q_SIZE + KV_SIZE + h * HEAD_DIM + d, mask=mask)
        tl.store(dst + Q_SIZE + KV_SIZE + h * HEAD_DIM + d, v, mask=mask)
