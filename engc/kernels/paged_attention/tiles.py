"""The @triton.jit helpers of the paged attention kernels (triton.py): loading a KV tile through the block
table (and widening quantized codes), one tile of the online softmax for decode and for prefill, and a
decode split's share of the tiles and its finish (output, or partial + ticket + in-launch combine).
triton.py's docstring describes the kernels, the tiling and the KV cache formats. Only the compiler
imports this module (through triton.py); codegen records it beside the kernel source (record.py).
"""
import triton
import triton.language as tl


@triton.jit
def _cache_rows(block_table_row, pos, valid, kvh, PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    """The cache rows (token slot * NUM_KV_HEADS + kvh) of positions pos: one round trip to the block table."""
    page = tl.load(block_table_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
    return (page * PAGE + pos % PAGE) * NUM_KV_HEADS + kvh


@triton.jit
def _load_rows(cache_ptr, rows, valid, d, HEAD_DIM: tl.constexpr):
    return tl.load(cache_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None] & (d[None, :] < HEAD_DIM),
                   other=0.0)


@triton.jit
def _load_kv_tile(cache_ptr, block_table_row, pos, valid, kvh, d,
                  PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    return _load_rows(cache_ptr, _cache_rows(block_table_row, pos, valid, kvh, PAGE, NUM_KV_HEADS), valid, d,
                      HEAD_DIM)


@triton.jit
def _widen(codes, dtype: tl.constexpr, KV_QUANT: tl.constexpr, PLACE_BITS: tl.constexpr):
    """A KV tile's codes in q's dtype. PLACE_BITS: fp8 codes into bf16/fp16 by bit placement, a power of two off
    (_fp8_units): the decode loop's choice. A prefill tile serves BLOCK_M query rows (128 at 8B heads), so its
    conversions weigh less, and placement's extra registers doubled its spills: it converts."""
    if KV_QUANT == 1:
        # int8 -> float with integer/fp32 ALU ops instead of conversions (16 a clock per SM on Hopper: they
        # bound the decode loop): the fp32 with bits 0x4B000080 + x is 2^23 + 128 + x, so subtracting
        # 2^23 + 128 leaves x exactly; |x| <= 128 has at most 8 significant bits, so its bf16 is the top
        # half of its fp32 bits.
        f = (codes.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        if dtype == tl.bfloat16:
            return (f.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return f.to(dtype)
    if PLACE_BITS and dtype == tl.bfloat16:
        # fp8 e4m3 -> bf16 by placing bits with integer ops, not by the three conversion instructions a pair of
        # values takes (e4m3 -> f16 -> bf16, 16 a clock per SM): s.eeee.mmm becomes s.0000eeee.mmm0000, the code
        # times 2^-120 exactly (exponent bias 127 against 7; subnormals too), which _scores and _pv undo
        # (_fp8_units). The int8 sign extension copies s into the bit the shift moves it to; the mask keeps the rest.
        return (((codes.to(tl.int8, bitcast=True).to(tl.int16) << 4) & -30736)).to(dtype, bitcast=True)   # 0x87F0
    if PLACE_BITS and dtype == tl.float16:   # the same into s.0eeee.mmm0000000: the code times 2^-8 (bias 15, 7)
        return (((codes.to(tl.int8, bitcast=True).to(tl.int16) << 7) & -16512)).to(dtype, bitcast=True)   # 0xBF80
    return codes.to(dtype)


@triton.jit
def _load_kv_scales(scale_ptr, block_table_row, pos, valid, kvh, PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    page = tl.load(block_table_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
    tok = page * PAGE + pos % PAGE
    return tl.load(scale_ptr + tok * NUM_KV_HEADS + kvh, mask=valid, other=0.0)


@triton.jit
def _fp8_units(dtype: tl.constexpr, KV_QUANT: tl.constexpr, PLACE_BITS: tl.constexpr):
    """(lift, back) around a dot with fp8 codes _widen placed into bf16 (the code times 2^-120): the other operand
    is lifted by 2^64, so its products with the smallest codes stay normal float32 instead of flushing to zero, and
    the dot's result multiplied back by 2^56. fp16's 2^-8 needs no lift. (1, 1) for every other cache and dtype."""
    if KV_QUANT == 2 and PLACE_BITS:
        if dtype == tl.bfloat16:
            return 18446744073709551616.0, 72057594037927936.0   # 2^64, 2^56
        if dtype == tl.float16:
            return 1.0, 256.0
    return 1.0, 1.0


@triton.jit
def _scores(q, k, k_scale, qk_scale, DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr, SOFTCAP: tl.constexpr,
            PLACE_BITS: tl.constexpr):
    """q k^T * qk_scale for one KV tile; a quantized cache's codes widened, then scaled per token.
    SOFTCAP (0: none): the scores capped as softcap * tanh(score / softcap) (Gemma 2), in the log2(e) units
    qk_scale carries, so the cap is SOFTCAP * log2(e) there."""
    if KV_QUANT != 0:
        lift, back = _fp8_units(q.dtype, KV_QUANT, PLACE_BITS)
        if lift != 1.0:
            q = (q.to(tl.float32) * lift).to(q.dtype)   # exact (a power of two); loop-invariant: hoisted
        s = tl.dot(q, tl.trans(_widen(k, q.dtype, KV_QUANT, PLACE_BITS)), input_precision=DOT_PRECISION) * (
            (qk_scale * back) * k_scale[None, :])
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP != 0.0:
        cap = SOFTCAP * 1.4426950408889634
        e = tl.exp(-2.0 * tl.abs(s / cap))    # tanh from exp of a non-positive argument: no overflow
        t = (1.0 - e) / (1.0 + e)
        s = cap * tl.where(s >= 0, t, -t)
    return s


@triton.jit
def _pv(p, v, v_scale, q, DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr, PLACE_BITS: tl.constexpr):
    """p v for one KV tile (in q's dtype); a quantized cache's per-token scales go onto p first."""
    if KV_QUANT != 0:
        lift, back = _fp8_units(q.dtype, KV_QUANT, PLACE_BITS)
        pv = tl.dot((p * (v_scale * lift)[None, :]).to(q.dtype), _widen(v, q.dtype, KV_QUANT, PLACE_BITS),
                    input_precision=DOT_PRECISION)
        if back != 1.0:
            pv = pv * back
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return pv


@triton.jit
def load_decode_tile(tile, ctx, start, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row, kvh, d,
                     PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_N: tl.constexpr, KV_QUANT: tl.constexpr):
    """The loads of one decode KV tile: (k, v, k_scale, v_scale); the scales are 0.0 for an unquantized
    cache. Split from decode_tile_math so a kernel can issue them ahead of other work (EARLY_KV)."""
    pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = (pos < ctx) & (pos >= start)
    k = _load_kv_tile(k_cache_ptr, bt_row, pos, valid, kvh, d, PAGE, NUM_KV_HEADS, HEAD_DIM)
    v = _load_kv_tile(v_cache_ptr, bt_row, pos, valid, kvh, d, PAGE, NUM_KV_HEADS, HEAD_DIM)
    if KV_QUANT != 0:
        k_scale = _load_kv_scales(k_scale_ptr, bt_row, pos, valid, kvh, PAGE, NUM_KV_HEADS)
        v_scale = _load_kv_scales(v_scale_ptr, bt_row, pos, valid, kvh, PAGE, NUM_KV_HEADS)
    else:
        k_scale = 0.0
        v_scale = 0.0
    return k, v, k_scale, v_scale


@triton.jit
def decode_tile_rows(tile, ctx, start, hi, bt_row, kvh, PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """(cache rows, valid) of decode tile `tile`: its block-table round trip alone, so a loop can take it ahead
    of the tile's K/V loads (prefetched_decode_tiles). Positions of tiles at or past hi are not valid."""
    pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = (pos < tl.minimum(ctx, hi * BLOCK_N)) & (pos >= start)
    return _cache_rows(bt_row, pos, valid, kvh, PAGE, NUM_KV_HEADS), valid


@triton.jit
def load_decode_rows(rows, valid, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, d, HEAD_DIM: tl.constexpr,
                     KV_QUANT: tl.constexpr):
    """load_decode_tile's loads from rows decode_tile_rows looked up: (k, v, k_scale, v_scale)."""
    k = _load_rows(k_cache_ptr, rows, valid, d, HEAD_DIM)
    v = _load_rows(v_cache_ptr, rows, valid, d, HEAD_DIM)
    if KV_QUANT != 0:
        k_scale = tl.load(k_scale_ptr + rows, mask=valid, other=0.0)
        v_scale = tl.load(v_scale_ptr + rows, mask=valid, other=0.0)
    else:
        k_scale = 0.0
        v_scale = 0.0
    return k, v, k_scale, v_scale


@triton.jit
def prefetched_decode_tiles(q, acc, m_i, l_i, k, v, k_scale, v_scale, lo, hi, ctx, start, k_cache_ptr, v_cache_ptr,
                            k_scale_ptr, v_scale_ptr, bt_row, kvh, d, qk_scale, PAGE: tl.constexpr,
                            NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                            DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr, SOFTCAP: tl.constexpr):
    """Tiles [lo, hi) of a decode program, tile lo already loaded (k, v and scales), software-pipelined by hand:
    while a tile's math runs, the next tile's K/V loads are in flight (into registers) and the block table entry of
    the one after. Triton's pipeliner (num_stages) spends its stages on the block table's indirection instead: it
    issues a tile's copies at the end of the iteration before and waits on them first thing, so each tile costs a
    memory round trip or two on top of its math. Entries that set PREFETCH run this loop with num_stages 1."""
    rows, valid = decode_tile_rows(lo + 1, ctx, start, hi, bt_row, kvh, PAGE, NUM_KV_HEADS, BLOCK_N)
    for tile in range(lo, hi):
        k_next, v_next, k_scale_next, v_scale_next = load_decode_rows(rows, valid, k_cache_ptr, v_cache_ptr,
                                                                      k_scale_ptr, v_scale_ptr, d, HEAD_DIM, KV_QUANT)
        rows, valid = decode_tile_rows(tile + 2, ctx, start, hi, bt_row, kvh, PAGE, NUM_KV_HEADS, BLOCK_N)
        acc, m_i, l_i = decode_tile_math(q, acc, m_i, l_i, k, v, k_scale, v_scale, tile, ctx, start, qk_scale, 0.0,
                                         0.0, 0.0, 0.0, BLOCK_N, DOT_PRECISION, KV_QUANT, False, SOFTCAP)
        k, v, k_scale, v_scale = k_next, v_next, k_scale_next, v_scale_next
    return acc, m_i, l_i


@triton.jit
def decode_tile_math(q, acc, m_i, l_i, k, v, k_scale, v_scale, tile, ctx, start, qk_scale, new_k, new_v,
                     new_k_scale, new_v_scale, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     KV_QUANT: tl.constexpr, WITH_NEW: tl.constexpr, SOFTCAP: tl.constexpr):
    """The online-softmax update of one decode KV tile loaded by load_decode_tile. WITH_NEW: the tile may
    hold the step's own token (position ctx - 1), whose k/v (codes and scales for a quantized cache) come
    in registers instead of from the cache. The tile must hold a visible position (else m is -inf: NaN)."""
    pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = (pos < ctx) & (pos >= start)
    if WITH_NEW:
        is_new = pos == ctx - 1
        k = tl.where(is_new[:, None], new_k[None, :], k)
        v = tl.where(is_new[:, None], new_v[None, :], v)
        if KV_QUANT != 0:
            k_scale = tl.where(is_new, new_k_scale, k_scale)
            v_scale = tl.where(is_new, new_v_scale, v_scale)
    s = _scores(q, k, k_scale, qk_scale, DOT_PRECISION, KV_QUANT, SOFTCAP, True)
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = _pv(p, v, v_scale, q, DOT_PRECISION, KV_QUANT, True)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def decode_tile(q, acc, m_i, l_i, tile, ctx, start, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row,
                kvh, d, qk_scale, new_k, new_v, new_k_scale, new_v_scale, PAGE: tl.constexpr,
                NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr, WITH_NEW: tl.constexpr, SOFTCAP: tl.constexpr):
    """One KV tile of the online softmax: load_decode_tile, then decode_tile_math."""
    k, v, k_scale, v_scale = load_decode_tile(tile, ctx, start, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                              bt_row, kvh, d, PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, KV_QUANT)
    return decode_tile_math(q, acc, m_i, l_i, k, v, k_scale, v_scale, tile, ctx, start, qk_scale, new_k, new_v,
                            new_k_scale, new_v_scale, BLOCK_N, DOT_PRECISION, KV_QUANT, WITH_NEW, SOFTCAP)


@triton.jit
def prefill_tile(q, acc, m_i, l_i, tile, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row, kvh, d,
                 q_pos, row_valid, last_pos, qk_scale, sliding_window, PAGE: tl.constexpr,
                 NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, KV_QUANT: tl.constexpr, SOFTCAP: tl.constexpr):
    """One KV tile of the online softmax for a prefill program's rows. MASKED: the tile may hold positions
    some rows must not see (past their own, or outside a sliding window); the others skip the mask."""
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
    else:
        k_scale = 0.0   # unread: a cache of the model's dtype has no scales
        v_scale = 0.0
    s = _scores(q, k, k_scale, qk_scale, DOT_PRECISION, KV_QUANT, SOFTCAP, False)
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
    pv = _pv(p, v, v_scale, q, DOT_PRECISION, KV_QUANT, False)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def decode_split(context_lens_ptr, b, split, sliding_window, num_splits, BLOCK_N: tl.constexpr):
    """(ctx, start, lo, hi, used) of a decode program: sequence b's context length, its first visible
    position, this split's KV tiles [lo, hi), and how many splits hold tiles (the rest, in a grid sized for
    a longer context, are empty)."""
    ctx = tl.load(context_lens_ptr + b)
    start = 0
    if sliding_window > 0:
        start = tl.maximum(ctx - sliding_window, 0)
    first_tile = start // BLOCK_N
    n_tiles = tl.cdiv(ctx, BLOCK_N) - first_tile
    per_split = tl.cdiv(n_tiles, num_splits)
    lo = first_tile + split * per_split
    hi = tl.minimum(lo + per_split, first_tile + n_tiles)
    return ctx, start, lo, hi, tl.cdiv(n_tiles, per_split)


@triton.jit
def early_decode_start(query_start_loc_ptr, context_lens_ptr, block_tables_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                       v_scale_ptr, sliding_window, num_splits, block_table_stride, D_PAD: tl.constexpr,
                       PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                       KV_QUANT: tl.constexpr):
    """A decode program's start under EARLY_KV 1 and 2 (paged_attention/triton.py): its sequence facts and
    its split's first KV tile, loaded before q so the two round trips overlap. -> (b, kvh, split, row, rows,
    ctx, start, lo, hi, used, d, bt_row, k0, v0, k0_scale, v0_scale); rows != 1 is the prefill kernel's."""
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(query_start_loc_ptr + b)
    rows = tl.load(query_start_loc_ptr + b + 1) - row
    ctx, start, lo, hi, used = decode_split(context_lens_ptr, b, split, sliding_window, num_splits, BLOCK_N)
    d = tl.arange(0, D_PAD)
    bt_row = block_tables_ptr + b.to(tl.int64) * block_table_stride
    k0, v0, k0_scale, v0_scale = load_decode_tile(lo, ctx, start, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                                  bt_row, kvh, d, PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, KV_QUANT)
    return b, kvh, split, row, rows, ctx, start, lo, hi, used, d, bt_row, k0, v0, k0_scale, v0_scale


@triton.jit
def finish_split(acc, m_i, l_i, out_ptr, part_acc_ptr, part_ml_ptr, counters_ptr, b, kvh, row, split,
                 num_splits, used, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, GR_PAD: tl.constexpr,
                 RED_SPLITS: tl.constexpr):
    """One split of the `used` that hold tiles (the kernels return early from the others, so a graph sized
    for a long context does not make a short one wait on empty splits; every caller's split holds one, as
    split < used means lo < hi in decode_split): the output itself when it is the
    only one, or its partial and a ticket; the last of the used splits to arrive combines them all (no reduce
    launch) and leaves its counter zero for the next launch or graph replay. acq_rel orders the partials
    before the ticket, and the winner's loads after it."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    out_mask = g_mask[:, None] & (d[None, :] < HEAD_DIM)
    pair = b * NUM_KV_HEADS + kvh
    if used == 1:
        o = acc / l_i[:, None]
        tl.store(out_ptr + row.to(tl.int64) * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (pair.to(tl.int64) * num_splits + split) * GROUP + g   # a pair's partials: [splits, GROUP]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)
        tl.debug_barrier()   # every thread's partial is stored before this program counts as arrived
        ticket = tl.atomic_add(counters_ptr + pair, 1, sem="acq_rel", scope="gpu")
        if ticket == used - 1:
            _combine_splits(part_acc_ptr, part_ml_ptr, out_ptr, pair, row, kvh, used, num_splits, NUM_HEADS,
                            HEAD_DIM, D_PAD, GROUP, GR_PAD, RED_SPLITS)
            tl.atomic_xchg(counters_ptr + pair, 0, sem="relaxed", scope="gpu")


@triton.jit
def _combine_splits(part_acc_ptr, part_ml_ptr, out_ptr, pair, row, kvh, used_splits, num_splits,
                    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
                    GR_PAD: tl.constexpr, RED_SPLITS: tl.constexpr):
    """out of one (sequence, KV head): the partials of its first used_splits splits, weighted by exp2 of
    their max over the running max, RED_SPLITS at a time. Each chunk's maxima, sums and accumulators load
    together (one memory round trip for the usual single chunk, not one for the maxima and one more for
    the rest); a later chunk rescales what came before, as the online softmax does. Loads bypass L1 (.cg):
    other programs wrote them."""
    g = tl.arange(0, GR_PAD)
    d = tl.arange(0, D_PAD)
    g_mask = g < GROUP
    base = pair.to(tl.int64) * num_splits
    m_run = tl.full([GR_PAD], float("-inf"), tl.float32)
    l_run = tl.zeros([GR_PAD], tl.float32)
    acc = tl.zeros([GR_PAD, D_PAD], tl.float32)
    s = tl.arange(0, RED_SPLITS)
    for first in range(0, used_splits, RED_SPLITS):
        ok = ((first + s)[:, None] < used_splits) & g_mask[None, :]
        rows = (base + first + s)[:, None] * GROUP + g[None, :]                   # [RED_SPLITS, GR_PAD]
        m_c = tl.load(part_ml_ptr + rows * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l_c = tl.load(part_ml_ptr + rows * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
        a = tl.load(part_acc_ptr + rows[:, :, None] * HEAD_DIM + d[None, None, :],
                    mask=ok[:, :, None] & (d[None, None, :] < HEAD_DIM), other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m_c, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)                                           # 0 before the first chunk
        w = tl.where(l_c > 0, tl.exp2(m_c - m_safe[None, :]), 0.0)
        l_run = l_run * alpha + tl.sum(l_c * w, axis=0)
        acc = acc * alpha[:, None] + tl.sum(a * w[:, :, None], axis=0)
        m_run = m_new
    o = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    heads = kvh * GROUP + g
    tl.store(out_ptr + row.to(tl.int64) * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & (d[None, :] < HEAD_DIM))
