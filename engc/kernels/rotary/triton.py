"""Rotary (rotate-half) on q and k fused with the write of k and v into the paged KV cache.

One program per token. tl.cos/tl.sin lower to libdevice's __nv_cosf/__nv_sinf (accurate for large
angles, unlike the sin.approx/cos.approx instructions; checked in the PTX).
A negative slot means "do not cache this token" (padding).
"""
import triton
import triton.language as tl


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
def rotary_kv_kernel(qkv_ptr, positions_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     q_out_ptr,
                     NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     H_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                     D_PAD: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    Q_SIZE: tl.constexpr = NUM_HEADS * HEAD_DIM
    KV_SIZE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    ROW: tl.constexpr = Q_SIZE + 2 * KV_SIZE
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.float32)
    f = tl.arange(0, HALF_PAD)
    inv_freq = tl.load(inv_freq_ptr + f, mask=f < HALF, other=0.0).to(tl.float32)
    freqs = (pos * inv_freq)[None, :]
    cos = tl.cos(freqs)
    sin = tl.sin(freqs)
    src = qkv_ptr + t * ROW
    _rotate_heads(src, q_out_ptr + t * Q_SIZE, cos, sin, NUM_HEADS, H_PAD, HEAD_DIM, HALF_PAD, HEAD_DIM)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        _rotate_heads(src + Q_SIZE, k_cache_ptr + slot * KV_SIZE, cos, sin, NUM_KV_HEADS, KV_PAD,
                      HEAD_DIM, HALF_PAD, HEAD_DIM)
        h = tl.arange(0, KV_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        v = tl.load(src + Q_SIZE + KV_SIZE + h * HEAD_DIM + d, mask=mask)
        tl.store(v_cache_ptr + slot * KV_SIZE + h * HEAD_DIM + d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
