"""The @triton.jit helpers of the MoE expert GEMMs (triton.py): the tensor-core dot, the decode GEMV's step, an
int4 weight tile dequantized in registers, and the body of each expert GEMM over BLOCK_M (token, slot) pairs of
one expert (gate_up_block, down_block), which the grouped, the decode and the fused decode kernels share.
triton.py's docstring describes the kernels and the weight forms. Only the compiler imports this module
(through triton.py); codegen records it beside the kernel source (record.py).
"""
import os

import triton
import triton.language as tl

from engc.kernels.silu_rows import silu_times_up

if os.environ.get("TRITON_INTERPRET") == "1":   # the interpreter's bf16/fp16 tl.dot is wrong: the same products in fp32
    @triton.jit
    def dot(a, b, acc, DOT_PRECISION: tl.constexpr):
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
else:
    @triton.jit
    def dot(a, b, acc, DOT_PRECISION: tl.constexpr):
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def gemv_step(acc, a, w, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [1, BLOCK_N] += a [1, BLOCK_K] . w [BLOCK_K, BLOCK_N] in float32 (decode: no tensor-core tile to
    fill; float8 codes widen exactly, and their products are exact in float32)."""
    return acc + tl.sum(a.to(tl.float32).reshape(BLOCK_K, 1) * w.to(tl.float32), axis=0).reshape(1, BLOCK_N)


@triton.jit
def int4_tile(q_base, s_base, z_base, n, kk, n_ok, K: tl.constexpr, GROUP: tl.constexpr):
    """w[k, n] of an int4 expert (kernels/int4_linear/layout: row n's words [K / 8], input 32c + 4j + i in
    nibble j of word 4c + i; scales and uint8 zeros [N, cdiv(K, GROUP)]) for kk (BLOCK_K) x n (BLOCK_N),
    dequantized as the layout's dequantize: (q - zero) in the scales' dtype, times the scale."""
    word = (kk // 32) * 4 + kk % 4
    shift = (kk % 32) // 4 * 4
    mask = n_ok[None, :] & (kk[:, None] < K)
    packed = tl.load(q_base + n[None, :].to(tl.int64) * (K // 8) + word[:, None], mask=mask, other=0)
    q = (packed >> shift[:, None]) & 0xF   # an arithmetic shift: the mask drops the sign bits
    groups: tl.constexpr = (K + GROUP - 1) // GROUP
    at = n[None, :].to(tl.int64) * groups + (kk // GROUP)[:, None]
    scale = tl.load(s_base + at, mask=mask, other=0.0)
    zero = tl.load(z_base + at, mask=mask, other=0).to(tl.int32)
    # (q - zero) times the scale is exact in float32 (a 5-bit integer times a model-dtype value); rounded
    # once to the model dtype it is torch's product in that dtype
    return ((q - zero).to(tl.float32) * scale.to(tl.float32)).to(scale.dtype)


@triton.jit
def gate_up_block(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, act_ptr, expert, pair, valid, n,
                  H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_W: tl.constexpr,
                  INT4_W: tl.constexpr):
    """act[pair, n] = silu(x W_gate^T) * (x W_up^T) of one expert (-1: none, every row and column masked off)
    for the BLOCK_M pairs `pair` (those not `valid` skipped) and the BLOCK_N columns n."""
    live = expert >= 0
    e64 = tl.maximum(expert, 0).to(tl.int64)
    # int4 experts: w_ptr their packed words (8 inputs a word), w_scale_ptr / w_zero_ptr each row's groups'
    W_ROW: tl.constexpr = H // 8 if INT4_W else H
    GROUPS: tl.constexpr = (H + INT4_W - 1) // INT4_W if INT4_W else 1
    w_base = w_ptr + e64 * (2 * INTER * W_ROW)
    token = (pair // TOP_K).to(tl.int64)
    n_ok = n < tl.where(live, INTER, 0)
    SWAP: tl.constexpr = FP8_W and BLOCK_M > 1   # [BLOCK_N, BLOCK_M] accumulators (triton.py's docstring)
    if SWAP:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + token[:, None] * H + kk[None, :], mask=valid[:, None] & (kk[None, :] < H), other=0.0)
        if SWAP:
            w_mask = n_ok[:, None] & (kk[None, :] < H)
            wg = tl.load(w_base + n[:, None] * H + kk[None, :], mask=w_mask, other=0.0)
            wu = tl.load(w_base + (n[:, None] + INTER) * H + kk[None, :], mask=w_mask, other=0.0)
            acc_g = dot(wg, tl.trans(a), acc_g, DOT_PRECISION)
            acc_u = dot(wu, tl.trans(a), acc_u, DOT_PRECISION)
        else:
            if INT4_W:
                g_base = e64 * (2 * INTER * GROUPS)
                wg = int4_tile(w_base, w_scale_ptr + g_base, w_zero_ptr + g_base, n, kk, n_ok, H, INT4_W)
                u_base = g_base + INTER * GROUPS
                wu = int4_tile(w_base + INTER * W_ROW, w_scale_ptr + u_base, w_zero_ptr + u_base, n, kk, n_ok, H,
                               INT4_W)
            else:
                w_mask = n_ok[None, :] & (kk[:, None] < H)
                wg = tl.load(w_base + n[None, :] * H + kk[:, None], mask=w_mask, other=0.0)
                wu = tl.load(w_base + (n[None, :] + INTER) * H + kk[:, None], mask=w_mask, other=0.0)
            if BLOCK_M == 1:
                acc_g = gemv_step(acc_g, a, wg, BLOCK_K, BLOCK_N)
                acc_u = gemv_step(acc_u, a, wu, BLOCK_K, BLOCK_N)
            else:
                acc_g = dot(a, wg, acc_g, DOT_PRECISION)
                acc_u = dot(a, wu, acc_u, DOT_PRECISION)
    dt = act_ptr.dtype.element_ty
    if FP8_W:   # the codes' sums times each output channel's and each token's scale
        s_base = w_scale_ptr + e64 * (2 * INTER)
        s_g = tl.load(s_base + n, mask=n_ok, other=0.0)
        s_u = tl.load(s_base + INTER + n, mask=n_ok, other=0.0)
        x_scale = tl.load(x_scale_ptr + token, mask=valid, other=0.0)
        if SWAP:
            acc_g = tl.trans(acc_g * s_g[:, None] * x_scale[None, :])
            acc_u = tl.trans(acc_u * s_u[:, None] * x_scale[None, :])
        else:
            acc_g = acc_g * s_g[None, :] * x_scale[:, None]
            acc_u = acc_u * s_u[None, :] * x_scale[:, None]
    # F.linear rounds gate and up to the model dtype before the silu
    act = silu_times_up(acc_g.to(dt).to(tl.float32), acc_u.to(dt).to(tl.float32), dt)
    # act is indexed by pair, not by schedule row: no padding rows to size, quantize or skip
    tl.store(act_ptr + pair.to(tl.int64)[:, None] * INTER + n[None, :], act, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def down_block(act_ptr, act_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, weights_ptr, expert, pair, valid, n, n_ok,
               dt: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_W: tl.constexpr, INT4_W: tl.constexpr):
    """weight[pair] * (act[pair] W_down^T)[:, n] of one expert for the BLOCK_M pairs `pair`, in dt: the expert's
    output rounded to dt, then weighted and rounded again (the pairs buffer's roundings). n_ok: the columns of
    a live expert below H."""
    e64 = tl.maximum(expert, 0).to(tl.int64)
    W_ROW: tl.constexpr = INTER // 8 if INT4_W else INTER
    GROUPS: tl.constexpr = (INTER + INT4_W - 1) // INT4_W if INT4_W else 1
    w_base = w_ptr + e64 * (H * W_ROW)
    SWAP: tl.constexpr = FP8_W and BLOCK_M > 1
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + pair.to(tl.int64)[:, None] * INTER + kk[None, :],
                    mask=valid[:, None] & (kk[None, :] < INTER), other=0.0)
        if SWAP:
            w = tl.load(w_base + n[:, None] * INTER + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < INTER),
                        other=0.0)
            acc = dot(w, tl.trans(a), acc, DOT_PRECISION)
        else:
            if INT4_W:
                g_base = e64 * (H * GROUPS)
                w = int4_tile(w_base, w_scale_ptr + g_base, w_zero_ptr + g_base, n, kk, n_ok, INTER, INT4_W)
            else:
                w = tl.load(w_base + n[None, :] * INTER + kk[:, None], mask=n_ok[None, :] & (kk[:, None] < INTER),
                            other=0.0)
            if BLOCK_M == 1:
                acc = gemv_step(acc, a, w, BLOCK_K, BLOCK_N)
            else:
                acc = dot(a, w, acc, DOT_PRECISION)
    if FP8_W:   # times each output channel's and each act row's scale
        s = tl.load(w_scale_ptr + e64 * H + n, mask=n_ok, other=0.0)
        a_scale = tl.load(act_scale_ptr + pair, mask=valid, other=0.0)
        if SWAP:
            acc = tl.trans(acc * s[:, None] * a_scale[None, :])
        else:
            acc = acc * s[None, :] * a_scale[:, None]
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    return (acc.to(dt).to(tl.float32) * weight[:, None]).to(dt)
