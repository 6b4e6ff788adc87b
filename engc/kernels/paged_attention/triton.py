"""Paged attention kernels: split-KV decode (+ its reduce) and varlen causal prefill/extend.

Both are GQA-aware: one program owns one KV head and every query head of its group, so each KV tile is
read once per group, not once per query head. KV tiles are BLOCK_N consecutive token positions; each
token's page comes from the block table (page = pos // PAGE), so BLOCK_N and PAGE are independent.
Scores use exp2 with the scale folded into log2(e).
KV_QUANT (constexpr; 0 model dtype, 1 int8, 2 fp8 e4m3) picks the cache format. A quantized cache
(kernels/kv_quant.py) holds codes plus one float32 scale per (token, KV head): codes are widened to q's
dtype (exact: |int8| <= 127 and e4m3 fit bf16/fp16; int8 through fp32, which is what the conversion
lowers to anyway), K's scale multiplies the scores after the dot and
V's the probabilities before it, both in fp32. The scale pointers are the last runtime params; the
unquantized build has them as constexpr None, so its code and arguments are as without quantization.

decode: grid (num_seqs, NUM_KV_HEADS, num_splits). Handles sequences with exactly one query token (it
  skips the others, so it can run beside the prefill kernel on a mixed batch). The KV tiles of a
  sequence are dealt to num_splits programs; with num_splits == 1 the program writes the output itself,
  otherwise it writes an unnormalized partial (acc, max, sum), takes a ticket on its (sequence, KV head)
  arrival counter, and the last to arrive combines the partials and writes the output (one launch, so
  small batches can split finely: the reduce costs no launch of its own).
decode_reduce: grid (num_seqs, NUM_HEADS). Combines the partials of the CUDA C++ decode template
  (templates/paged_decode.cu.j2), which leaves them laid out [seq, head, split] for this second launch.
prefill: grid (cdiv(max_query_len, BLOCK_M // GROUP), num_seqs, NUM_KV_HEADS). Row m of a program's
  tile is query token m // GROUP of its slice and head m % GROUP of the group. With skip_decode != 0
  it leaves one-token sequences to the decode kernel.
"""
import triton
import triton.language as tl

from engc.kernels import pdl


@triton.jit
def _load_kv_tile(cache_ptr, block_table_row, pos, valid, kvh, d,
                  PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    page = tl.load(block_table_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
    tok = page * PAGE + pos % PAGE
    ptrs = cache_ptr + (tok * NUM_KV_HEADS + kvh)[:, None] * HEAD_DIM + d[None, :]
    return tl.load(ptrs, mask=valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _widen(codes, dtype: tl.constexpr, KV_QUANT: tl.constexpr):
    if KV_QUANT == 1:
        # int8 -> float with integer/fp32 ALU ops instead of conversions (16 a clock per SM on Hopper: they
        # bound the decode loop): the fp32 with bits 0x4B000080 + x is 2^23 + 128 + x, so subtracting
        # 2^23 + 128 leaves x exactly; |x| <= 128 has at most 8 significant bits, so its bf16 is the top
        # half of its fp32 bits.
        f = (codes.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        if dtype == tl.bfloat16:
            return (f.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return f.to(dtype)
    return codes.to(dtype)


@triton.jit
def _load_kv_scales(scale_ptr, block_table_row, pos, valid, kvh, PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    page = tl.load(block_table_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
    tok = page * PAGE + pos % PAGE
    return tl.load(scale_ptr + tok * NUM_KV_HEADS + kvh, mask=valid, other=0.0)


@triton.jit
def _combine_splits(part_acc_ptr, part_ml_ptr, out_ptr, pair, row, kvh, used_splits, num_splits,
                    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
                    GR_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr, RED_SPLITS: tl.constexpr):
    """out of one (sequence, KV head): the partials of its first used_splits splits, weighted by exp2 of
    their max over the global max. Loads bypass L1 (.cg): other programs wrote them."""
    g = tl.arange(0, GR_PAD)
    d = tl.arange(0, D_PAD)
    g_mask = g < GROUP
    base = pair.to(tl.int64) * num_splits
    s_all = tl.arange(0, MAX_SPLITS)
    ml_mask = (s_all[:, None] < used_splits) & g_mask[None, :]
    ml = (base + s_all)[:, None] * GROUP + g[None, :]
    m = tl.load(part_ml_ptr + ml * 2, mask=ml_mask, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_ml_ptr + ml * 2 + 1, mask=ml_mask, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.sum(tl.where(l > 0, l * tl.exp2(m - m_max[None, :]), 0.0), axis=0)
    acc = tl.zeros([GR_PAD, D_PAD], tl.float32)
    s = tl.arange(0, RED_SPLITS)
    for first in range(0, used_splits, RED_SPLITS):
        ok = ((first + s)[:, None] < used_splits) & g_mask[None, :]
        rows = (base + first + s)[:, None] * GROUP + g[None, :]                   # [RED_SPLITS, GR_PAD]
        m_c = tl.load(part_ml_ptr + rows * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l_c = tl.load(part_ml_ptr + rows * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
        w = tl.where(l_c > 0, tl.exp2(m_c - m_max[None, :]), 0.0)
        a = tl.load(part_acc_ptr + rows[:, :, None] * HEAD_DIM + d[None, None, :],
                    mask=ok[:, :, None] & (d[None, None, :] < HEAD_DIM), other=0.0, cache_modifier=".cg")
        acc += tl.sum(a * w[:, :, None], axis=0)
    o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    heads = kvh * GROUP + g
    tl.store(out_ptr + row.to(tl.int64) * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def _split_tiles(ctx, sliding_window, split, num_splits, BLOCK_N: tl.constexpr):
    """(start, lo, hi, used): the first visible position, this split's KV tiles [lo, hi), and how many
    splits hold tiles (the rest, in a grid sized for a longer context, are empty)."""
    start = 0
    if sliding_window > 0:
        start = tl.maximum(ctx - sliding_window, 0)
    first_tile = start // BLOCK_N
    n_tiles = tl.cdiv(ctx, BLOCK_N) - first_tile
    per_split = tl.cdiv(n_tiles, num_splits)
    lo = first_tile + split * per_split
    hi = tl.minimum(lo + per_split, first_tile + n_tiles)
    return start, lo, hi, tl.cdiv(n_tiles, per_split)


@triton.jit
def _decode_tile(q, acc, m_i, l_i, tile, ctx, start, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row,
                 kvh, d, qk_scale, new_k, new_v, new_k_scale, new_v_scale, PAGE: tl.constexpr,
                 NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr, WITH_NEW: tl.constexpr):
    """One KV tile of the online softmax. WITH_NEW: the tile holds the step's own token (position ctx - 1),
    whose k/v (codes and scales for a quantized cache) come in registers instead of from the cache."""
    pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = (pos < ctx) & (pos >= start)
    k = _load_kv_tile(k_cache_ptr, bt_row, pos, valid, kvh, d, PAGE, NUM_KV_HEADS, HEAD_DIM)
    v = _load_kv_tile(v_cache_ptr, bt_row, pos, valid, kvh, d, PAGE, NUM_KV_HEADS, HEAD_DIM)
    if KV_QUANT != 0:
        k_scale = _load_kv_scales(k_scale_ptr, bt_row, pos, valid, kvh, PAGE, NUM_KV_HEADS)
        v_scale = _load_kv_scales(v_scale_ptr, bt_row, pos, valid, kvh, PAGE, NUM_KV_HEADS)
    if WITH_NEW:
        is_new = pos == ctx - 1
        k = tl.where(is_new[:, None], new_k[None, :], k)
        v = tl.where(is_new[:, None], new_v[None, :], v)
        if KV_QUANT != 0:
            k_scale = tl.where(is_new, new_k_scale, k_scale)
            v_scale = tl.where(is_new, new_v_scale, v_scale)
    if KV_QUANT != 0:
        s = tl.dot(q, tl.trans(_widen(k, q.dtype, KV_QUANT)), input_precision=DOT_PRECISION) * (qk_scale * k_scale[None, :])
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV_QUANT != 0:
        pv = tl.dot((p * v_scale[None, :]).to(q.dtype), _widen(v, q.dtype, KV_QUANT), input_precision=DOT_PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _finish_split(acc, m_i, l_i, has_tiles, out_ptr, part_acc_ptr, part_ml_ptr, counters_ptr, b, kvh, row, split,
                  num_splits, used, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, GR_PAD: tl.constexpr,
                  MAX_SPLITS: tl.constexpr, RED_SPLITS: tl.constexpr):
    """One split: the output itself, or its partial and a ticket; the last split to arrive combines them
    all (no reduce launch) and leaves its counter zero for the next launch or graph replay. acq_rel
    orders the partials before the ticket, and the winner's loads after it."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    out_mask = g_mask[:, None] & (d[None, :] < HEAD_DIM)
    pair = b * NUM_KV_HEADS + kvh
    if num_splits == 1:
        o = acc / l_i[:, None]
        tl.store(out_ptr + row.to(tl.int64) * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        if has_tiles:   # partial rows of a (sequence, KV head) are contiguous: [splits, GROUP]
            part = (pair.to(tl.int64) * num_splits + split) * GROUP + g
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
            tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)
        tl.debug_barrier()   # every thread's partial is stored before this program counts as arrived
        ticket = tl.atomic_add(counters_ptr + pair, 1, sem="acq_rel", scope="gpu")
        if ticket == num_splits - 1:
            _combine_splits(part_acc_ptr, part_ml_ptr, out_ptr, pair, row, kvh, used, num_splits, NUM_HEADS,
                            HEAD_DIM, D_PAD, GROUP, GR_PAD, MAX_SPLITS, RED_SPLITS)
            tl.atomic_xchg(counters_ptr + pair, 0, sem="relaxed", scope="gpu")


@triton.jit
def paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                        query_start_loc_ptr, out_ptr, part_acc_ptr, part_ml_ptr, counters_ptr,
                        scale, sliding_window, block_table_stride, num_splits, k_scale_ptr, v_scale_ptr,
                        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                        GR_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr, RED_SPLITS: tl.constexpr,
                        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        KV_QUANT: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(query_start_loc_ptr + b)
    qlen = tl.load(query_start_loc_ptr + b + 1) - row
    if qlen != 1:
        return
    ctx = tl.load(context_lens_ptr + b)
    start, lo, hi, used = _split_tiles(ctx, sliding_window, split, num_splits, BLOCK_N)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + row.to(tl.int64) * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                mask=(g < GROUP)[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    qk_scale = scale * 1.4426950408889634
    bt_row = block_tables_ptr + b.to(tl.int64) * block_table_stride
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for tile in range(lo, hi):
        acc, m_i, l_i = _decode_tile(q, acc, m_i, l_i, tile, ctx, start, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                     v_scale_ptr, bt_row, kvh, d, qk_scale, 0.0, 0.0, 0.0, 0.0, PAGE, NUM_KV_HEADS,
                                     HEAD_DIM, BLOCK_N, DOT_PRECISION, KV_QUANT, False)
    _finish_split(acc, m_i, l_i, lo < hi, out_ptr, part_acc_ptr, part_ml_ptr, counters_ptr, b, kvh, row, split,
                  num_splits, used, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, D_PAD, GROUP, G_PAD, GR_PAD, MAX_SPLITS,
                  RED_SPLITS)


@triton.jit
def _rope(x, partner, cos, sin, d, HALF: tl.constexpr):
    """Rotate-half on rows laid out whole: partner[..., i] is x[..., (i + HALF) % HEAD_DIM]; fp32 result."""
    sign = tl.where(d < HALF, -1.0, 1.0)
    return x.to(tl.float32) * cos + sign * partner.to(tl.float32) * sin


@triton.jit
def _quantize_row(x, KV_QUANT: tl.constexpr):
    """One (token, KV head) row, fp32 [D_PAD] zero-padded -> (codes as fp32, scale): kernels/kv_quant.py."""
    QMAX: tl.constexpr = 127.0 if KV_QUANT == 1 else 448.0
    amax = tl.max(tl.abs(x), axis=0)
    inv = tl.where(amax > 0, QMAX / amax, 0.0)
    y = tl.minimum(tl.maximum(x * inv, -QMAX), QMAX)
    if KV_QUANT == 1:
        y = tl.minimum(tl.floor(y + 0.5), QMAX)
    return y, amax / QMAX


@triton.jit
def paged_decode_rotary_kernel(qkv_ptr, positions_ptr, inv_freq_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr,
                               block_tables_ptr, context_lens_ptr, query_start_loc_ptr, out_ptr, part_acc_ptr,
                               part_ml_ptr, counters_ptr, scale, sliding_window, block_table_stride, num_splits,
                               k_scale_ptr, v_scale_ptr,
                               NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                               GR_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr, RED_SPLITS: tl.constexpr,
                               PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                               KV_QUANT: tl.constexpr, PDL: tl.constexpr):
    """decode fused with the rotary op before it (RotaryPagedAttention on a decode-only step): each program
    rotates its group's q heads from qkv itself; the split holding the new token (the last tile) also
    rotates its KV head's k, writes k and v (quantized for a quantized cache) to the cache slot for later
    steps, and uses them in registers for that token, so no program reads the slot in this launch."""
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    Q_SIZE: tl.constexpr = NUM_HEADS * HEAD_DIM
    KV_SIZE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(query_start_loc_ptr + b)
    qlen = tl.load(query_start_loc_ptr + b + 1) - row
    if qlen != 1:
        return
    ctx = tl.load(context_lens_ptr + b)
    start, lo, hi, used = _split_tiles(ctx, sliding_window, split, num_splits, BLOCK_N)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    partner = (d + HALF) % HEAD_DIM
    angle = tl.load(positions_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + d % HALF, mask=d_mask, other=0.0)
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    src = qkv_ptr + row.to(tl.int64) * (Q_SIZE + 2 * KV_SIZE)
    q_rows = src + (kvh * GROUP + g)[:, None] * HEAD_DIM
    q_mask = (g < GROUP)[:, None] & d_mask[None, :]
    q = _rope(tl.load(q_rows + d[None, :], mask=q_mask, other=0.0),
              tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0), cos[None, :], sin[None, :], d[None, :],
              HALF).to(qkv_ptr.dtype.element_ty)
    k_row = src + Q_SIZE + kvh * HEAD_DIM
    new_k = _rope(tl.load(k_row + d, mask=d_mask, other=0.0), tl.load(k_row + partner, mask=d_mask, other=0.0),
                  cos, sin, d, HALF).to(qkv_ptr.dtype.element_ty)
    new_v = tl.load(src + Q_SIZE + KV_SIZE + kvh * HEAD_DIM + d, mask=d_mask, other=0.0)
    slot = tl.load(slot_mapping_ptr + row)
    owner = (lo < hi) & (hi == tl.cdiv(ctx, BLOCK_N))     # the split whose last tile holds the new token
    write = owner & (slot >= 0)                          # a negative slot (a padded row) writes nothing
    dst = slot * KV_SIZE + kvh * HEAD_DIM + d
    if KV_QUANT != 0:   # codes and scales of the rows as rounded to the model dtype (as the rotary op)
        k_codes, new_k_scale = _quantize_row(new_k.to(tl.float32), KV_QUANT)
        v_codes, new_v_scale = _quantize_row(new_v.to(tl.float32), KV_QUANT)
        new_k = k_codes.to(k_cache_ptr.dtype.element_ty)
        new_v = v_codes.to(v_cache_ptr.dtype.element_ty)
        if write:
            tl.store(k_scale_ptr + slot * NUM_KV_HEADS + kvh, new_k_scale)
            tl.store(v_scale_ptr + slot * NUM_KV_HEADS + kvh, new_v_scale)
    else:
        new_k_scale = 0.0
        new_v_scale = 0.0
    if write:
        tl.store(k_cache_ptr + dst, new_k.to(k_cache_ptr.dtype.element_ty), mask=d_mask)
        tl.store(v_cache_ptr + dst, new_v.to(v_cache_ptr.dtype.element_ty), mask=d_mask)

    qk_scale = scale * 1.4426950408889634
    bt_row = block_tables_ptr + b.to(tl.int64) * block_table_stride
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for tile in range(lo, hi - owner.to(tl.int32)):
        acc, m_i, l_i = _decode_tile(q, acc, m_i, l_i, tile, ctx, start, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                     v_scale_ptr, bt_row, kvh, d, qk_scale, 0.0, 0.0, 0.0, 0.0, PAGE, NUM_KV_HEADS,
                                     HEAD_DIM, BLOCK_N, DOT_PRECISION, KV_QUANT, False)
    if owner:
        acc, m_i, l_i = _decode_tile(q, acc, m_i, l_i, hi - 1, ctx, start, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                     v_scale_ptr, bt_row, kvh, d, qk_scale, new_k, new_v, new_k_scale, new_v_scale,
                                     PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, DOT_PRECISION, KV_QUANT, True)
    _finish_split(acc, m_i, l_i, lo < hi, out_ptr, part_acc_ptr, part_ml_ptr, counters_ptr, b, kvh, row, split,
                  num_splits, used, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, D_PAD, GROUP, G_PAD, GR_PAD, MAX_SPLITS,
                  RED_SPLITS)


@triton.jit
def paged_decode_reduce_kernel(query_start_loc_ptr, part_acc_ptr, part_ml_ptr, out_ptr, num_splits,
                               NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                               MAX_SPLITS: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(query_start_loc_ptr + b)
    if tl.load(query_start_loc_ptr + b + 1) - row != 1:
        return
    s = tl.arange(0, MAX_SPLITS)
    d = tl.arange(0, D_PAD)
    s_mask = s < num_splits
    part = (b.to(tl.int64) * NUM_HEADS + h) * num_splits + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(l > 0, tl.exp2(m - m_max), 0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
                  mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + row.to(tl.int64) * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + d,
             o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _prefill_tile(q, acc, m_i, l_i, tile, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row, kvh, d,
                  q_pos, row_valid, last_pos, qk_scale, sliding_window, PAGE: tl.constexpr,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, KV_QUANT: tl.constexpr):
    pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if MASKED:
        valid = pos <= last_pos
    else:
        valid = pos >= 0
    k = _load_kv_tile(k_cache_ptr, bt_row, pos, valid, kvh, d, PAGE, NUM_KV_HEADS, HEAD_DIM)
    v = _load_kv_tile(v_cache_ptr, bt_row, pos, valid, kvh, d, PAGE, NUM_KV_HEADS, HEAD_DIM)
    if KV_QUANT != 0:
        k_scale = _load_kv_scales(k_scale_ptr, bt_row, pos, valid, kvh, PAGE, NUM_KV_HEADS)
        v_scale = _load_kv_scales(v_scale_ptr, bt_row, pos, valid, kvh, PAGE, NUM_KV_HEADS)
        s = tl.dot(q, tl.trans(_widen(k, q.dtype, KV_QUANT)), input_precision=DOT_PRECISION) * (qk_scale * k_scale[None, :])
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
        if sliding_window > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV_QUANT != 0:
        pv = tl.dot((p * v_scale[None, :]).to(q.dtype), _widen(v, q.dtype, KV_QUANT), input_precision=DOT_PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def paged_prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                         query_start_loc_ptr, out_ptr, scale, sliding_window, block_table_stride,
                         skip_decode, k_scale_ptr, v_scale_ptr,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         D_PAD: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         KV_QUANT: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    q_tile = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    qlen = tl.load(query_start_loc_ptr + b + 1) - q_start
    if q_tile * TOKENS >= qlen:
        return
    if (skip_decode != 0) & (qlen == 1):
        return
    ctx = tl.load(context_lens_ptr + b)
    m_idx = tl.arange(0, BLOCK_M)
    tok = q_tile * TOKENS + m_idx // GROUP
    head = kvh * GROUP + m_idx % GROUP
    row_valid = (m_idx < TOKENS * GROUP) & (tok < qlen)
    q_pos = ctx - qlen + tok
    d = tl.arange(0, D_PAD)
    q_rows = (q_start + tok).to(tl.int64) * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_valid[:, None] & (d[None, :] < HEAD_DIM),
                other=0.0)

    first_pos = ctx - qlen + q_tile * TOKENS
    last_pos = ctx - qlen + tl.minimum(q_tile * TOKENS + TOKENS, qlen) - 1
    qk_scale = scale * 1.4426950408889634
    bt_row = block_tables_ptr + b.to(tl.int64) * block_table_stride
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # Tiles wholly at or before every row's position need no mask (the causal prefix); a sliding window
    # masks everywhere. Rows past qlen attend there too, harmlessly: they are never stored.
    full_tiles = (first_pos + 1) // BLOCK_N
    masked_start = full_tiles
    if sliding_window > 0:
        full_tiles = 0
        masked_start = tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N
    for tile in range(0, full_tiles):
        acc, m_i, l_i = _prefill_tile(q, acc, m_i, l_i, tile, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                      bt_row, kvh, d, q_pos, row_valid, last_pos, qk_scale, sliding_window,
                                      PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, DOT_PRECISION, False, KV_QUANT)
    for tile in range(masked_start, tl.cdiv(last_pos + 1, BLOCK_N)):
        acc, m_i, l_i = _prefill_tile(q, acc, m_i, l_i, tile, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                      bt_row, kvh, d, q_pos, row_valid, last_pos, qk_scale, sliding_window,
                                      PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, DOT_PRECISION, True, KV_QUANT)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & (d[None, :] < HEAD_DIM))
