"""The MoE op's kernels: routing, the sort by expert, the experts' gate_up (SiLU-and-mul fused) and down GEMMs,
the combine.

moe_router_kernel      grid (cdiv(T, BLOCK_T), cdiv(E, BLOCK_E)): the router logits x router^T, rounded to the
                       model dtype as F.linear's; many programs share the router's read (one program a token
                       reading all of it took ~40 us a layer, a third of a Qwen3-30B-A3B batch-1 step). The
                       "_small" variants (a decode step's few tokens) give each program one token and two
                       experts, summed without tensor cores: 64 programs at Qwen3-30B-A3B's 128 experts, each
                       a short row read, where 16-expert tiles left 8 programs looping over the hidden size
moe_route_kernel       grid (T,): softmax, top-k of those logits (ties to the lower expert id), the weights
                       (_route_token, which the fused decode gate_up calls too); the shared expert's sigmoid gate
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
                       the decode variant (PAIR_ORDER, BLOCK_M 1): one pair a program in pair order, its block's
                       expert the pair's id, reading only its expert's weights
moe_down_kernel        grid (row blocks, cdiv(H, BLOCK_N)): pairs[pair] = weight[pair] * (act[pair] W_down^T)
moe_combine_kernel     grid (T, cdiv(H, BLOCK)): y[t] = sum over the token's k pairs (+ its gated shared
                       expert's output, whose two GEMMs are the library's: they are dense)

The fused decode forms (the "gate_up_decode" / "down_decode" variants of a routing without a shared expert:
Mixtral, Qwen3-MoE, OLMoE, where the tune table's field "fused" turns each on) make the decode path three
launches, the router and these two, where the others take five: at batch 1 each launch costs a few
microseconds of ramp beyond its reads (H200, in a CUDA graph). The fused down has TOP_K times fewer programs
than the unfused one, each reading its token's TOP_K experts' rows in turn: which form is faster is for a step
A/B to say per arch.
moe_gate_up_route_kernel  grid (T * k, cdiv(I, BLOCK_N)): each program routes its pair's token from the router's
                       logits (_route_token: the token's routing recomputed by its k * I / BLOCK_N programs, no
                       route launch), takes its slot's expert, and computes act[pair] as moe_gate_up_kernel's
                       decode variant; the first N tile's programs store the pair's weight and expert for the
                       down kernel, which runs after it in stream order
moe_down_combine_kernel   grid (T, cdiv(H, BLOCK_N)): y[t] for one N tile, the token's k pairs in slot order, each
                       rounded as moe_down_kernel rounds its pair, summed as moe_combine_kernel sums them (the
                       same result, bit for bit; no pairs buffer, no combine launch)
The GEMMs' bodies (tiles.py: gate_up_block, down_block) are one code for the grouped, decode and fused kernels.

Every kernel here can take programmatic dependent launch (kernels/pdl.py; its tune entry's PDL, off until a step
A/B on the arch keeps it): each waits on the kernel before it first (every input but the weights is an earlier
kernel's), then lets the next one launch, so a decode step's MoE launches would overlap the previous kernel's
tail as the dense kernels' do.

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
import triton
import triton.language as tl

from engc.kernels import pdl
from engc.kernels.moe.tiles import down_block, dot, gate_up_block


@triton.jit
def moe_router_kernel(x_ptr, router_ptr, logits_ptr, T, H: tl.constexpr, E: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
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
            acc = dot(a, w, acc, DOT_PRECISION)
        else:   # the small variants: a few experts a program, products summed in float32 (no tile to fill)
            w = tl.load(router_ptr + e[:, None] * H + kk[None, :], mask=(e[:, None] < E) & (kk[None, :] < H),
                        other=0.0)
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(logits_ptr + t[:, None].to(tl.int64) * E + e[None, :], acc.to(logits_ptr.dtype.element_ty),
             mask=(t[:, None] < T) & (e[None, :] < E))


@triton.jit
def _route_token(logits_ptr, t, softmax_first, renormalize, float32_weights, dt: tl.constexpr, E: tl.constexpr,
                 TOP_K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """Token t's routing from its router logits (model dtype): softmax then top-k of the probabilities
    (renormalized or not), or top-k of the logits then their softmax; ties to the lower expert id. Returns
    (weights [K_PAD] float32, rounded to dt unless float32_weights; expert ids [K_PAD] int32), slot order,
    the lanes past TOP_K unused."""
    e = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + t * E + e, mask=e < E, other=0.0).to(tl.float32)
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
    return vals, ids


@triton.jit
def moe_route_kernel(x_ptr, logits_ptr, shared_gate_ptr, weights_ptr, ids_ptr, shared_weight_ptr,
                     softmax_first, renormalize, float32_weights, H: tl.constexpr, E: tl.constexpr,
                     TOP_K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_SHARED: tl.constexpr, PDL: tl.constexpr):
    # softmax_first, renormalize and float32_weights are the node's attributes (runtime flags: the model
    # config has no routing)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    t = tl.program_id(0).to(tl.int64)
    dt = x_ptr.dtype.element_ty
    vals, ids = _route_token(logits_ptr, t, softmax_first, renormalize, float32_weights, dt, E, TOP_K, E_PAD,
                             K_PAD)
    slot = tl.arange(0, K_PAD)
    tl.store(weights_ptr + t * TOP_K + slot, vals, mask=slot < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slot, ids, mask=slot < TOP_K)
    if HAS_SHARED:   # the shared expert's gate: one row, read here
        shared = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * H + kk, mask=kk < H, other=0.0).to(tl.float32)
            shared += tl.load(shared_gate_ptr + kk, mask=kk < H, other=0.0).to(tl.float32) * x
        g = tl.sum(shared, axis=0).to(dt).to(tl.float32)
        tl.store(shared_weight_ptr + t, (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32))


@triton.jit
def _schedule_rows(rows_ptr, pid_m, BLOCK_M: tl.constexpr, PAIR_ORDER: tl.constexpr):
    """The (token, slot) pairs of row block pid_m: the sort's schedule, or with PAIR_ORDER (the decode variants,
    BLOCK_M 1) pair pid_m itself, so a decode step makes no row list (rows_ptr unread)."""
    if PAIR_ORDER:
        return pid_m + tl.arange(0, BLOCK_M)
    return tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))


@triton.jit
def moe_gate_up_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, rows_ptr, block_expert_ptr, act_ptr,
                       num_pairs, H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       FP8_W: tl.constexpr, INT4_W: tl.constexpr, PAIR_ORDER: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    pid_m = tl.program_id(0)
    # blocks past the last expert's are padding (expert -1): every row and column masked off
    expert = tl.load(block_expert_ptr + pid_m)
    pair = _schedule_rows(rows_ptr, pid_m, BLOCK_M, PAIR_ORDER)
    valid = pair < tl.where(expert >= 0, num_pairs, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_up_block(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, act_ptr, expert, pair, valid, n, H, INTER,
                  TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, FP8_W, INT4_W)


@triton.jit
def moe_gate_up_route_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, logits_ptr, weights_ptr, ids_ptr,
                             act_ptr, softmax_first, renormalize, float32_weights, H: tl.constexpr,
                             INTER: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr, E_PAD: tl.constexpr,
                             K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             FP8_W: tl.constexpr, INT4_W: tl.constexpr, PDL: tl.constexpr):
    # program (t * TOP_K + slot, N tile): the token's routing, as moe_route_kernel's, then its slot's expert
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    pair = tl.program_id(0)
    t = (pair // TOP_K).to(tl.int64)
    vals, ids = _route_token(logits_ptr, t, softmax_first, renormalize, float32_weights,
                             act_ptr.dtype.element_ty, E, TOP_K, E_PAD, K_PAD)
    slot = tl.arange(0, K_PAD)
    mine = slot == pair % TOP_K
    if tl.program_id(1) == 0:   # the first N tile's programs hand each pair's weight and expert to the down GEMM
        tl.store(weights_ptr + t * TOP_K + slot, vals, mask=mine)
        tl.store(ids_ptr + t * TOP_K + slot, ids, mask=mine)
    expert = tl.sum(tl.where(mine, ids, 0), axis=0)
    pairs = pair + tl.arange(0, 1)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # one pair a program: the GEMV, whose float32 sums take no dot precision ("ieee" unread)
    gate_up_block(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, act_ptr, expert, pairs, pairs >= 0, n, H,
                  INTER, TOP_K, 1, BLOCK_N, BLOCK_K, "ieee", FP8_W, INT4_W)


@triton.jit
def moe_down_kernel(act_ptr, act_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, rows_ptr, block_expert_ptr, weights_ptr,
                    pairs_ptr, num_pairs, H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_W: tl.constexpr,
                    INT4_W: tl.constexpr, PAIR_ORDER: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    live = expert >= 0
    pair = _schedule_rows(rows_ptr, pid_m, BLOCK_M, PAIR_ORDER)
    valid = pair < tl.where(live, num_pairs, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < tl.where(live, H, 0)
    y = down_block(act_ptr, act_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, weights_ptr, expert, pair, valid, n, n_ok,
                   pairs_ptr.dtype.element_ty, H, INTER, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, FP8_W, INT4_W)
    tl.store(pairs_ptr + pair.to(tl.int64)[:, None] * H + n[None, :], y, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def moe_down_combine_kernel(act_ptr, act_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, ids_ptr, weights_ptr, out_ptr,
                            H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, FP8_W: tl.constexpr, INT4_W: tl.constexpr, PDL: tl.constexpr):
    # program (t, N tile): the token's pairs in slot order, each as moe_down_kernel computes and rounds it,
    # summed as moe_combine_kernel sums them
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K):
        pair = t * TOP_K + j
        pairs = pair + tl.arange(0, 1)
        y = down_block(act_ptr, act_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, weights_ptr, tl.load(ids_ptr + pair),
                       pairs, pairs >= 0, n, n_ok, dt, H, INTER, 1, BLOCK_N, BLOCK_K, "ieee", FP8_W, INT4_W)
        acc += y.to(tl.float32)
    tl.store(out_ptr + t * H + n[None, :], acc.to(dt), mask=n_ok[None, :])


@triton.jit
def moe_combine_kernel(pairs_ptr, shared_ptr, shared_weight_ptr, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr,
                       HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
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
                              HAS_SHARED: tl.constexpr, PDL: tl.constexpr):
    # x_ptr is read for its dtype only (the weights' rounding); the float32 logits are moe_router_kernel's
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
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
                    E_PAD: tl.constexpr, RANK_BLOCK: tl.constexpr, SCAN_BLOCK: tl.constexpr, PDL: tl.constexpr):
    # A counting sort: every program counts all the ids (a histogram, cheap next to ranking) and ranks its own
    # span of pairs, so the programs need not wait on one another; no atomics, so the rows are the same each run
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
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
