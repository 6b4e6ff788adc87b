"""The MoE op's kernels: routing, the sort by expert, the experts' gate_up (SiLU-and-mul fused) and down GEMMs,
the combine.

moe_router_kernel      grid (cdiv(T, BLOCK_T), cdiv(E, BLOCK_E)): the router logits x router^T, rounded to the
                       model dtype as F.linear's; many programs share the router's read (one program a token
                       reading all of it took ~40 us a layer, a third of a Qwen3-30B-A3B batch-1 step). The
                       "_small" variants (a decode step's few tokens) give each program one token and two
                       experts, summed without tensor cores: 64 programs at Qwen3-30B-A3B's 128 experts, each
                       a short row read, where 16-expert tiles left 8 programs looping over the hidden size
moe_route_kernel       grid (T,): softmax, top-k of those logits (ties to the lower expert id), the weights;
                       the shared expert's sigmoid gate
moe_route_deepseek_kernel  grid (T,): DeepSeek's routings of moe_router_kernel's float32 logits (its
                       float32-output specialization, as HF computes them), softmax or sigmoid scores, the
                       correction bias, the experts of the topk_group best of n_group groups (a group scored
                       by its best expert or its best two), top-k, renormalization, the scaling factor; the
                       routing's numbers are runtime arguments (the node's attributes), one compiled kernel
moe_sort_kernel        grid (up to max_programs,): the grouped GEMMs' schedule, sort_by_expert's exactly: a
                       counting sort of the (token, slot) pairs by expert (each program counts every id, then
                       ranks its own span in pair order), each expert padded to BLOCK_M rows (a runtime
                       argument: one kernel serves the grouped and the prefill pairs), each block's expert
moe_gate_up_kernel     grid (row blocks, cdiv(I, BLOCK_N)): act[pair] = silu(x W_gate^T) * (x W_up^T) of the block's
                       expert, for BLOCK_M (token, slot) pairs listed under it (moe_sort_kernel's schedule);
                       BLOCK_M 1 is the decode path: one pair a program, reading only its expert's weights
moe_down_kernel        grid (row blocks, cdiv(H, BLOCK_N)): pairs[pair] = weight[pair] * (act[pair] W_down^T)
moe_combine_kernel     grid (T, cdiv(H, BLOCK)): y[t] = sum over the token's k pairs (+ its gated shared
                       expert's output, whose two GEMMs are the library's: they are dense)

Accumulation is float32; outputs round to the storage dtype where the reference's torch ops do (the GLU's
silu and product, each expert's output before it is weighted).

FP8_W (an fp8 bundle's experts, kernels/moe fp8_experts) is W8A8, as the dense fp8 projections: the weights
are float8 e4m3 codes with a float32 scale per output channel (w_scale_ptr, [E, N]), and the inputs come
quantized per row by kernels/fp8_quant (x's tokens for gate_up, act's pairs for down; x_scale_ptr /
act_scale_ptr their scales). The grouped variants dot the codes on the FP8 tensor cores with the operands
swapped (the weight tile [BLOCK_N, BLOCK_K] as the MMA's A operand, the few rows an expert has as its narrow
N side; fp8 wgmma wants both operands K-contiguous, which the weights' [N, K] rows and the gathered input
rows are), as kernels/fp8_linear does; both operands stream from memory into the MMA as float tiles do.
Converting float8 weight tiles to bf16 in registers for a bf16 dot ran at half the copy rate, and quantizing
the input tile in registers inside the K loop at a fifth of it. The decode GEMV widens both codes to float32
(exact products). The float32 sums are multiplied by the channel's and the row's scales before the rounding;
without FP8_W the kernels read no scale.

INT4_W (the group size of int4 experts from an AWQ/GPTQ checkpoint or engc quantize; 0 for others) is W4A16:
the weights are the engc int4 layout (kernels/int4_linear/layout), each tile dequantized in registers as the
layout's dequantize computes it (bit for bit), then the float dot or GEMV; w_zero_ptr is read only then.
"""
import os

import triton
import triton.language as tl

from engc.kernels.silu_rows import silu_times_up

if os.environ.get("TRITON_INTERPRET") == "1":   # the interpreter's bf16/fp16 tl.dot is wrong: the same products in fp32
    @triton.jit
    def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
else:
    @triton.jit
    def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def moe_router_kernel(x_ptr, router_ptr, logits_ptr, T, H: tl.constexpr, E: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + t[:, None].to(tl.int64) * H + kk[None, :], mask=(t[:, None] < T) & (kk[None, :] < H),
                    other=0.0)
        if BLOCK_T >= 16 and BLOCK_E >= 16:
            w = tl.load(router_ptr + e[None, :] * H + kk[:, None], mask=(e[None, :] < E) & (kk[:, None] < H),
                        other=0.0)
            acc = _dot(a, w, acc, DOT_PRECISION)
        else:   # the small variants: a few experts a program, products summed in float32 (no tile to fill)
            w = tl.load(router_ptr + e[:, None] * H + kk[None, :], mask=(e[:, None] < E) & (kk[None, :] < H),
                        other=0.0)
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(logits_ptr + t[:, None].to(tl.int64) * E + e[None, :], acc.to(logits_ptr.dtype.element_ty),
             mask=(t[:, None] < T) & (e[None, :] < E))


@triton.jit
def moe_route_kernel(x_ptr, logits_ptr, shared_gate_ptr, weights_ptr, ids_ptr, shared_weight_ptr,
                     softmax_first, renormalize, float32_weights, H: tl.constexpr, E: tl.constexpr,
                     TOP_K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_SHARED: tl.constexpr):
    # softmax_first, renormalize and float32_weights are the node's attributes (runtime flags: the model
    # config has no routing)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    dt = x_ptr.dtype.element_ty
    logits = tl.load(logits_ptr + t * E + e, mask=e < E, other=0.0).to(tl.float32)   # model dtype, as F.linear's
    if HAS_SHARED:   # the shared expert's gate: one row, read here
        shared = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * H + kk, mask=kk < H, other=0.0).to(tl.float32)
            shared += tl.load(shared_gate_ptr + kk, mask=kk < H, other=0.0).to(tl.float32) * x
    logits = tl.where(e < E, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=0))
    scores = tl.where(softmax_first != 0, p / tl.sum(p, axis=0), logits)
    slot = tl.arange(0, K_PAD)
    vals = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, axis=0)
        pick = tl.min(tl.where(scores == best, e, E_PAD), axis=0)
        vals = tl.where(slot == j, best, vals)
        ids = tl.where(slot == j, pick, ids)
        scores = tl.where(e == pick, float("-inf"), scores)
    in_k = slot < TOP_K
    q = tl.where(in_k, tl.exp(vals - tl.max(tl.where(in_k, vals, float("-inf")), axis=0)), 0.0)
    renormalized = vals / tl.sum(tl.where(in_k, vals, 0.0), axis=0)
    vals = tl.where(softmax_first == 0, q / tl.sum(q, axis=0), tl.where(renormalize != 0, renormalized, vals))
    vals = tl.where(float32_weights != 0, vals, vals.to(dt).to(tl.float32))   # Mixtral's stay float32
    tl.store(weights_ptr + t * TOP_K + slot, vals, mask=slot < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slot, ids, mask=slot < TOP_K)
    if HAS_SHARED:
        g = tl.sum(shared, axis=0).to(dt).to(tl.float32)
        tl.store(shared_weight_ptr + t, (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32))


@triton.jit
def _gemv_step(acc, a, w, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [1, BLOCK_N] += a [1, BLOCK_K] . w [BLOCK_K, BLOCK_N] in float32 (decode: no tensor-core tile to
    fill; float8 codes widen exactly, and their products are exact in float32)."""
    return acc + tl.sum(a.to(tl.float32).reshape(BLOCK_K, 1) * w.to(tl.float32), axis=0).reshape(1, BLOCK_N)


@triton.jit
def _int4_tile(q_base, s_base, z_base, n, kk, n_ok, K: tl.constexpr, GROUP: tl.constexpr):
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
def moe_gate_up_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, rows_ptr, block_expert_ptr, act_ptr,
                       num_pairs, H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       FP8_W: tl.constexpr, INT4_W: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    # blocks past the last expert's are padding (expert -1): every row and column masked off
    live = expert >= 0
    e64 = tl.maximum(expert, 0).to(tl.int64)
    # int4 experts: w_ptr their packed words (8 inputs a word), w_scale_ptr / w_zero_ptr each row's groups'
    W_ROW: tl.constexpr = H // 8 if INT4_W else H
    GROUPS: tl.constexpr = (H + INT4_W - 1) // INT4_W if INT4_W else 1
    w_base = w_ptr + e64 * (2 * INTER * W_ROW)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + offs_m)
    valid = pair < tl.where(live, num_pairs, 0)
    token = (pair // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < tl.where(live, INTER, 0)
    SWAP: tl.constexpr = FP8_W and BLOCK_M > 1   # [BLOCK_N, BLOCK_M] accumulators (the module's docstring)
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
            acc_g = _dot(wg, tl.trans(a), acc_g, DOT_PRECISION)
            acc_u = _dot(wu, tl.trans(a), acc_u, DOT_PRECISION)
        else:
            if INT4_W:
                g_base = e64 * (2 * INTER * GROUPS)
                wg = _int4_tile(w_base, w_scale_ptr + g_base, w_zero_ptr + g_base, n, kk, n_ok, H, INT4_W)
                u_base = g_base + INTER * GROUPS
                wu = _int4_tile(w_base + INTER * W_ROW, w_scale_ptr + u_base, w_zero_ptr + u_base, n, kk, n_ok, H,
                                INT4_W)
            else:
                w_mask = n_ok[None, :] & (kk[:, None] < H)
                wg = tl.load(w_base + n[None, :] * H + kk[:, None], mask=w_mask, other=0.0)
                wu = tl.load(w_base + (n[None, :] + INTER) * H + kk[:, None], mask=w_mask, other=0.0)
            if BLOCK_M == 1:
                acc_g = _gemv_step(acc_g, a, wg, BLOCK_K, BLOCK_N)
                acc_u = _gemv_step(acc_u, a, wu, BLOCK_K, BLOCK_N)
            else:
                acc_g = _dot(a, wg, acc_g, DOT_PRECISION)
                acc_u = _dot(a, wu, acc_u, DOT_PRECISION)
    dt = act_ptr.dtype.element_ty
    if FP8_W:   # the codes' sums times each output channel's and each token's scale
        s_base = w_scale_ptr + tl.maximum(expert, 0).to(tl.int64) * (2 * INTER)
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
def moe_down_kernel(act_ptr, act_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, rows_ptr, block_expert_ptr, weights_ptr,
                    pairs_ptr, num_pairs, H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_W: tl.constexpr,
                    INT4_W: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    live = expert >= 0
    e64 = tl.maximum(expert, 0).to(tl.int64)
    W_ROW: tl.constexpr = INTER // 8 if INT4_W else INTER
    GROUPS: tl.constexpr = (INTER + INT4_W - 1) // INT4_W if INT4_W else 1
    w_base = w_ptr + e64 * (H * W_ROW)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + offs_m)
    valid = pair < tl.where(live, num_pairs, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < tl.where(live, H, 0)
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
            acc = _dot(w, tl.trans(a), acc, DOT_PRECISION)
        else:
            if INT4_W:
                g_base = e64 * (H * GROUPS)
                w = _int4_tile(w_base, w_scale_ptr + g_base, w_zero_ptr + g_base, n, kk, n_ok, INTER, INT4_W)
            else:
                w = tl.load(w_base + n[None, :] * INTER + kk[:, None], mask=n_ok[None, :] & (kk[:, None] < INTER),
                            other=0.0)
            if BLOCK_M == 1:
                acc = _gemv_step(acc, a, w, BLOCK_K, BLOCK_N)
            else:
                acc = _dot(a, w, acc, DOT_PRECISION)
    if FP8_W:   # times each output channel's and each act row's scale
        s = tl.load(w_scale_ptr + tl.maximum(expert, 0).to(tl.int64) * H + n, mask=n_ok, other=0.0)
        a_scale = tl.load(act_scale_ptr + pair, mask=valid, other=0.0)
        if SWAP:
            acc = tl.trans(acc * s[:, None] * a_scale[None, :])
        else:
            acc = acc * s[None, :] * a_scale[:, None]
    dt = pairs_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    y = acc.to(dt).to(tl.float32) * weight[:, None]
    tl.store(pairs_ptr + pair.to(tl.int64)[:, None] * H + n[None, :], y.to(dt), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def moe_combine_kernel(pairs_ptr, shared_ptr, shared_weight_ptr, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr,
                       HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (t * TOP_K + j) * H + n, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    if HAS_SHARED:   # sigmoid(gate) * the shared expert's output, rounded as the reference's product is
        s = tl.load(shared_ptr + t * H + n, mask=mask, other=0.0).to(tl.float32)
        acc += (s * tl.load(shared_weight_ptr + t)).to(dt).to(tl.float32)
    tl.store(out_ptr + t * H + n, acc.to(dt), mask=mask)


@triton.jit
def moe_route_deepseek_kernel(x_ptr, logits_ptr, bias_ptr, weights_ptr, ids_ptr, shared_weight_ptr,
                              sigmoid_scores, has_bias, n_group, topk_group, group_top2, renormalize,
                              routed_scaling_factor, float32_weights, E: tl.constexpr, TOP_K: tl.constexpr,
                              E_PAD: tl.constexpr, K_PAD: tl.constexpr, G_PAD: tl.constexpr,
                              HAS_SHARED: tl.constexpr):
    # x_ptr is read for its dtype only (the weights' rounding); the float32 logits are moe_router_kernel's
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    dt = x_ptr.dtype.element_ty
    live = e < E
    logits = tl.load(logits_ptr + t * E + e, mask=live, other=float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=0))
    scores = tl.where(sigmoid_scores != 0, 1.0 / (1.0 + tl.exp(-logits)), p / tl.sum(p, axis=0))
    scores = tl.where(live, scores, 0.0)
    bias = tl.where(has_bias != 0, tl.load(bias_ptr + e, mask=live, other=0.0).to(tl.float32), 0.0)
    choice = tl.where(live, scores + bias, float("-inf"))
    # masked experts: 0 under softmax scores (all positive), -inf under a correction bias, as HF masks them
    masked = tl.where(has_bias != 0, float("-inf"), 0.0)
    if n_group > 1:
        size = E // n_group
        group = e // size
        g = tl.arange(0, G_PAD)
        group_scores = tl.full([G_PAD], float("-inf"), tl.float32)
        for j in range(0, n_group):
            mine = live & (group == j)
            best = tl.max(tl.where(mine, choice, float("-inf")), axis=0)
            first = tl.min(tl.where(mine & (choice == best), e, E_PAD), axis=0)
            second = tl.max(tl.where(mine & (e != first), choice, float("-inf")), axis=0)
            score = tl.where(group_top2 != 0, best + second, best)
            group_scores = tl.where(g == j, score, group_scores)
        keep = tl.zeros([E_PAD], dtype=tl.int32)
        for _ in range(0, topk_group):
            best = tl.max(group_scores, axis=0)
            pick = tl.min(tl.where(group_scores == best, g, G_PAD), axis=0)
            keep = tl.where(group == pick, 1, keep)
            group_scores = tl.where(g == pick, float("-inf"), group_scores)
        choice = tl.where((keep != 0) & live, choice, tl.where(live, masked, float("-inf")))
    slot = tl.arange(0, K_PAD)
    vals = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        pick = tl.min(tl.where(choice == best, e, E_PAD), axis=0)
        # the weight is the unbiased score (under a bias) or the choice's value
        w = tl.where(has_bias != 0, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), best)
        vals = tl.where(slot == j, w, vals)
        ids = tl.where(slot == j, pick, ids)
        choice = tl.where(e == pick, float("-inf"), choice)
    in_k = slot < TOP_K
    total = tl.sum(tl.where(in_k, vals, 0.0), axis=0)
    vals = tl.where(renormalize != 0, vals / (total + 1e-20), vals) * routed_scaling_factor
    vals = tl.where(float32_weights != 0, vals, vals.to(dt).to(tl.float32))
    tl.store(weights_ptr + t * TOP_K + slot, vals, mask=in_k)
    tl.store(ids_ptr + t * TOP_K + slot, ids, mask=in_k)
    if HAS_SHARED:   # DeepSeek's shared experts are added ungated
        tl.store(shared_weight_ptr + t, 1.0)


@triton.jit
def _count_experts(ids_ptr, lo, hi, E_PAD: tl.constexpr, SCAN_BLOCK: tl.constexpr):
    """The pairs of each expert among ids[lo:hi]."""
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c in range(lo, hi, SCAN_BLOCK):
        i = c + tl.arange(0, SCAN_BLOCK)
        counts += tl.histogram(tl.load(ids_ptr + i, mask=i < hi, other=0), E_PAD)
    # the last chunk's lanes past hi were counted as expert 0
    short = tl.cdiv(hi - lo, SCAN_BLOCK) * SCAN_BLOCK - (hi - lo)
    return counts - tl.where(tl.arange(0, E_PAD) == 0, short, 0)


@triton.jit
def moe_sort_kernel(ids_ptr, rows_ptr, block_expert_ptr, num_pairs, block_m, num_blocks, E: tl.constexpr,
                    E_PAD: tl.constexpr, RANK_BLOCK: tl.constexpr, SCAN_BLOCK: tl.constexpr):
    # A counting sort: every program counts all the ids (a histogram, cheap next to ranking) and ranks its own
    # span of pairs, so the programs need not wait on one another; no atomics, so the rows are the same each run
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    e = tl.arange(0, E_PAD)
    span = tl.cdiv(tl.cdiv(num_pairs, programs), RANK_BLOCK) * RANK_BLOCK
    lo = tl.minimum(pid * span, num_pairs)
    hi = tl.minimum(lo + span, num_pairs)
    before = _count_experts(ids_ptr, 0, lo, E_PAD, SCAN_BLOCK)
    counts = before + _count_experts(ids_ptr, lo, num_pairs, E_PAD, SCAN_BLOCK)
    padded = (counts + block_m - 1) // block_m * block_m
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    # a pair's row: its expert's start plus the pairs of that expert before it, in pair order (stable)
    base = start + before
    for c in range(lo, hi, RANK_BLOCK):
        i = c + tl.arange(0, RANK_BLOCK)
        ok = i < hi
        hit = (tl.load(ids_ptr + i, mask=ok, other=E_PAD)[:, None] == e[None, :]).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit
        tl.store(rows_ptr + tl.sum(hit * (rank + base[None, :]), axis=1), i, mask=ok)
        base += tl.sum(hit, axis=0)
    # the padding rows (num_pairs), shared out among the programs: each expert's rows past its pairs (fewer
    # than block_m, 16 at a time) ...
    fill = start + counts
    for j0 in range(pid * 16, block_m - 1, programs * 16):
        q = fill[:, None] + j0 + tl.arange(0, 16)[None, :]
        tl.store(rows_ptr + q, num_pairs, mask=q < end[:, None])
    # ... and the rows past the last expert's, up to the fixed size
    size = num_blocks * block_m
    for q0 in range(tl.sum(padded, axis=0) + pid * SCAN_BLOCK, size, programs * SCAN_BLOCK):
        q = q0 + tl.arange(0, SCAN_BLOCK)
        tl.store(rows_ptr + q, num_pairs, mask=q < size)
    # a block's expert: the experts that end at or before its first row (a searchsorted); -1 past the last
    for b0 in range(pid * RANK_BLOCK, num_blocks, programs * RANK_BLOCK):
        b = b0 + tl.arange(0, RANK_BLOCK)
        owner = tl.sum(((end[None, :] <= b[:, None] * block_m) & (e[None, :] < E)).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(owner < E, owner, -1), mask=b < num_blocks)
