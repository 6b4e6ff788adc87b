"""Rotary (rotate-half) on q and k fused with the write of k and v into the paged KV cache.

One program per token. tl.cos/tl.sin lower to libdevice's __nv_cosf/__nv_sinf (accurate for large
angles, unlike the sin.approx/cos.approx instructions; checked in the PTX).
A negative slot means "do not cache this token" (padding).
KV_QUANT (constexpr; 0 model dtype, 1 int8, 2 fp8 e4m3) picks the cache format: a quantized cache gets
each (token, KV head) row of k and v as codes plus a float32 scale (kernels/kv_quant.py), the scale
pointers (the last runtime params) being constexpr None in the unquantized build, so that kernel's code
and arguments are as before.
"""
import triton
import triton.language as tl

from engc.kernels import pdl


@triton.jit
def _rotate_heads(src, dst, cos, sin, N_HEADS: tl.constexpr, H_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, dst_head_stride):
    HALF: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < N_HEADS) & (d < HALF)
    x1 = tl.load(src + h * HEAD_DIM + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * HEAD_DIM + HALF + d, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    tl.store(dst + h * dst_head_stride + d, o1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + h * dst_head_stride + HALF + d, o2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _store_quantized(dst, scale_dst, x1, x2, NUM_KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, KV_QUANT: tl.constexpr):
    """Rows x1 | x2 ([KV_PAD, HALF_PAD] halves of each head, fp32, zero where padded): codes and a scale."""
    QMAX: tl.constexpr = 127.0 if KV_QUANT == 1 else 448.0
    HALF: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, KV_PAD)
    h = heads[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HALF)
    amax = tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1))
    inv = tl.where(amax > 0, QMAX / amax, 0.0)
    y1 = tl.minimum(tl.maximum(x1 * inv[:, None], -QMAX), QMAX)
    y2 = tl.minimum(tl.maximum(x2 * inv[:, None], -QMAX), QMAX)
    if KV_QUANT == 1:
        y1 = tl.minimum(tl.floor(y1 + 0.5), QMAX)
        y2 = tl.minimum(tl.floor(y2 + 0.5), QMAX)
    tl.store(dst + h * HEAD_DIM + d, y1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + h * HEAD_DIM + HALF + d, y2.to(dst.dtype.element_ty), mask=mask)
    tl.store(scale_dst + heads, amax / QMAX, mask=heads < NUM_KV_HEADS)


@triton.jit
def _write_quantized(src, k_dst, v_dst, ks_dst, vs_dst, cos, sin, NUM_KV_HEADS: tl.constexpr,
                     KV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
                     KV_QUANT: tl.constexpr):
    """Rotated k and plain v of one token, rounded to the model dtype first (as the reference has them)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    KV_SIZE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    h = tl.arange(0, KV_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HALF)
    k1 = tl.load(src + h * HEAD_DIM + d, mask=mask, other=0.0)
    k2 = tl.load(src + h * HEAD_DIM + HALF + d, mask=mask, other=0.0)
    x1, x2 = k1.to(tl.float32), k2.to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(k1.dtype).to(tl.float32)
    o2 = (x2 * cos + x1 * sin).to(k1.dtype).to(tl.float32)
    _store_quantized(k_dst, ks_dst, o1, o2, NUM_KV_HEADS, KV_PAD, HEAD_DIM, HALF_PAD, KV_QUANT)
    v1 = tl.load(src + KV_SIZE + h * HEAD_DIM + d, mask=mask, other=0.0).to(tl.float32)
    v2 = tl.load(src + KV_SIZE + h * HEAD_DIM + HALF + d, mask=mask, other=0.0).to(tl.float32)
    _store_quantized(v_dst, vs_dst, v1, v2, NUM_KV_HEADS, KV_PAD, HEAD_DIM, HALF_PAD, KV_QUANT)


@triton.jit
def rotary_kv_kernel(qkv_ptr, positions_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     q_out_ptr, k_scale_ptr, v_scale_ptr,
                     NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     H_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                     D_PAD: tl.constexpr, KV_QUANT: tl.constexpr, PDL: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    Q_SIZE: tl.constexpr = NUM_HEADS * HEAD_DIM
    KV_SIZE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    ROW: tl.constexpr = Q_SIZE + 2 * KV_SIZE
    t = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, HALF_PAD)
    inv_freq = tl.load(inv_freq_ptr + f, mask=f < HALF, other=0.0).to(tl.float32)   # a constant
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    pos = tl.load(positions_ptr + t).to(tl.float32)
    freqs = (pos * inv_freq)[None, :]
    cos = tl.cos(freqs)
    sin = tl.sin(freqs)
    src = qkv_ptr + t * ROW
    _rotate_heads(src, q_out_ptr + t * Q_SIZE, cos, sin, NUM_HEADS, H_PAD, HEAD_DIM, HALF_PAD, HEAD_DIM)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if KV_QUANT != 0:
        if slot >= 0:
            _write_quantized(src + Q_SIZE, k_cache_ptr + slot * KV_SIZE, v_cache_ptr + slot * KV_SIZE,
                             k_scale_ptr + slot * NUM_KV_HEADS, v_scale_ptr + slot * NUM_KV_HEADS, cos, sin,
                             NUM_KV_HEADS, KV_PAD, HEAD_DIM, HALF_PAD, KV_QUANT)
    elif slot >= 0:
        _rotate_heads(src + Q_SIZE, k_cache_ptr + slot * KV_SIZE, cos, sin, NUM_KV_HEADS, KV_PAD,
                      HEAD_DIM, HALF_PAD, HEAD_DIM)
        h = tl.arange(0, KV_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        v = tl.load(src + Q_SIZE + KV_SIZE + h * HEAD_DIM + d, mask=mask)
        tl.store(v_cache_ptr + slot * KV_SIZE + h * HEAD_DIM + d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
