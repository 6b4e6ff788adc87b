"""Paged attention kernels: split-KV decode (+ its reduce) and varlen causal prefill/extend.

Both are GQA-aware: one program owns one KV head and every query head of its group, so each KV tile is
read once per group, not once per query head. KV tiles are BLOCK_N consecutive token positions; each
token's page comes from the block table (page = pos // PAGE), so BLOCK_N and PAGE are independent.
Scores use exp2 with the scale folded into log2(e).
KV_QUANT (constexpr; 0 model dtype, 1 int8, 2 fp8 e4m3) picks the cache format. A quantized cache
(kernels/kv_quant.py) holds codes plus one float32 scale per (token, KV head): codes are widened to q's
dtype exactly (int8 with integer ops through fp32 bits; e4m3 in the decode by placing its bits in a bf16/fp16,
a power of two off, which the dots undo, and in the prefill by conversion: tiles._widen), K's scale multiplies
the scores after the dot and V's the probabilities before it, both in fp32. The scale pointers are the last
runtime params; the unquantized build has them as constexpr None, so its code and arguments are as without
quantization.

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
from engc.kernels.paged_attention import tiles


@triton.jit
def paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                        query_start_loc_ptr, out_ptr, part_acc_ptr, part_ml_ptr, counters_ptr,
                        scale, sliding_window, block_table_stride, num_splits, k_scale_ptr, v_scale_ptr,
                        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                        GR_PAD: tl.constexpr, RED_SPLITS: tl.constexpr,
                        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        KV_QUANT: tl.constexpr, PDL: tl.constexpr, EARLY_KV: tl.constexpr,
                        SOFTCAP: tl.constexpr, PREFETCH: tl.constexpr):
    """EARLY_KV: 1 (and 2) load the context length with the query offsets and the first KV tile before q.
    Unlike paged_decode_rotary_kernel, 2 does not move them before the PDL wait: the kernel before this one
    is the rotary kernel, which writes the new token's K/V into the cache, maybe into that first tile.
    PREFETCH: the tiles' loads pipelined by hand (tiles.prefetched_decode_tiles), not by Triton."""
    if EARLY_KV == 0:
        pdl.wait(PDL)
        pdl.launch_dependents(PDL)
        b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row = tl.load(query_start_loc_ptr + b)
        if tl.load(query_start_loc_ptr + b + 1) - row != 1:   # not one query token: the prefill kernel's
            return
        ctx, start, lo, hi, used = tiles.decode_split(context_lens_ptr, b, split, sliding_window, num_splits,
                                                      BLOCK_N)
        if split >= used:   # no tiles (a grid sized for a longer context): finish_split counts the used only
            return
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
    else:
        pdl.wait(PDL)
        pdl.launch_dependents(PDL)
        b, kvh, split, row, rows, ctx, start, lo, hi, used, d, bt_row, k0, v0, k0_scale, v0_scale = \
            tiles.early_decode_start(query_start_loc_ptr, context_lens_ptr, block_tables_ptr, k_cache_ptr,
                                     v_cache_ptr, k_scale_ptr, v_scale_ptr, sliding_window, num_splits,
                                     block_table_stride, D_PAD, PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, KV_QUANT)
        if (rows != 1) | (split >= used):   # the prefill kernel's sequence, or a split without tiles
            return
        g = tl.arange(0, G_PAD)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + row.to(tl.int64) * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                mask=(g < GROUP)[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    qk_scale = scale * 1.4426950408889634
    if EARLY_KV == 0:
        bt_row = block_tables_ptr + b.to(tl.int64) * block_table_stride
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    if PREFETCH:
        if EARLY_KV == 0:
            k0, v0, k0_scale, v0_scale = tiles.load_decode_tile(lo, ctx, start, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                                                v_scale_ptr, bt_row, kvh, d, PAGE, NUM_KV_HEADS,
                                                                HEAD_DIM, BLOCK_N, KV_QUANT)
        acc, m_i, l_i = tiles.prefetched_decode_tiles(q, acc, m_i, l_i, k0, v0, k0_scale, v0_scale, lo, hi, ctx, start,
                                                      k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row, kvh,
                                                      d, qk_scale, PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N,
                                                      DOT_PRECISION, KV_QUANT, SOFTCAP)
    else:
        if EARLY_KV == 0:
            first_loaded = lo
        else:
            first_loaded = lo + 1   # every split left here holds tile lo (split < used)
            acc, m_i, l_i = tiles.decode_tile_math(q, acc, m_i, l_i, k0, v0, k0_scale, v0_scale, lo, ctx, start,
                                                   qk_scale, 0.0, 0.0, 0.0, 0.0, BLOCK_N, DOT_PRECISION, KV_QUANT,
                                                   False, SOFTCAP)
        for tile in range(first_loaded, hi):
            acc, m_i, l_i = tiles.decode_tile(q, acc, m_i, l_i, tile, ctx, start, k_cache_ptr, v_cache_ptr,
                                              k_scale_ptr, v_scale_ptr, bt_row, kvh, d, qk_scale, 0.0, 0.0, 0.0, 0.0,
                                              PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, DOT_PRECISION, KV_QUANT, False,
                                              SOFTCAP)
    tiles.finish_split(acc, m_i, l_i, out_ptr, part_acc_ptr, part_ml_ptr, counters_ptr, b, kvh, row, split,
                       num_splits, used, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, D_PAD, GROUP, G_PAD, GR_PAD,
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
                               GR_PAD: tl.constexpr, RED_SPLITS: tl.constexpr,
                               PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                               KV_QUANT: tl.constexpr, PDL: tl.constexpr, EARLY_KV: tl.constexpr,
                               SOFTCAP: tl.constexpr):
    """decode fused with the rotary op before it (RotaryPagedAttention on a decode-only step): each program
    rotates its group's q heads from qkv itself; the split holding the new token (the last tile) also
    rotates its KV head's k, writes k and v (quantized for a quantized cache) to the cache slot for later
    steps, and uses them in registers for that token, so no program reads the slot in this launch.

    EARLY_KV (the order of the memory round trips; a small-batch program is a chain of them, not bandwidth):
      0  wait; sequence facts; qkv, rope and the new token's cache store; then the split's KV tiles (their
         loads cannot pass the store, which may alias them).
      1  the split's first KV tile (block table, then K/V) is loaded before the rotary and the store, and
         the context length with the query offsets instead of after them: the K/V round trip overlaps the
         qkv one. The tile's stale copy of the new slot, if it holds it, is replaced from registers.
      2  as 1, and with PDL those loads, the positions and slots and the rope angles come before wait():
         they read what no kernel of this step writes before this one (the staged step metadata, and
         cache rows of earlier steps: the new row is the one taken from registers), so they overlap the
         kernel before (the QKV projection); only qkv is read, and anything written, after wait()."""
    HALF: tl.constexpr = HEAD_DIM // 2
    Q_SIZE: tl.constexpr = NUM_HEADS * HEAD_DIM
    KV_SIZE: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    if EARLY_KV == 0:
        pdl.wait(PDL)
        pdl.launch_dependents(PDL)
        b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row = tl.load(query_start_loc_ptr + b)
        if tl.load(query_start_loc_ptr + b + 1) - row != 1:   # not one query token: the prefill kernel's
            return
        ctx, start, lo, hi, used = tiles.decode_split(context_lens_ptr, b, split, sliding_window, num_splits,
                                                      BLOCK_N)
        if split >= used:   # no tiles, so not the owner either: nothing to write or count
            return
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        d_mask = d < HEAD_DIM
        partner = (d + HALF) % HEAD_DIM
        angle = tl.load(positions_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + d % HALF, mask=d_mask,
                                                                      other=0.0)
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    else:
        if EARLY_KV == 1:
            pdl.wait(PDL)
            pdl.launch_dependents(PDL)
        b, kvh, split, row, rows, ctx, start, lo, hi, used, d, bt_row, k0, v0, k0_scale, v0_scale = \
            tiles.early_decode_start(query_start_loc_ptr, context_lens_ptr, block_tables_ptr, k_cache_ptr,
                                     v_cache_ptr, k_scale_ptr, v_scale_ptr, sliding_window, num_splits,
                                     block_table_stride, D_PAD, PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, KV_QUANT)
        if split >= used:   # no tiles, so not the owner either: leaves before the wait, counted by no one
            return
        d_mask = d < HEAD_DIM
        angle = tl.load(positions_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + d % HALF, mask=d_mask,
                                                                      other=0.0)
        cos = tl.cos(angle)
        sin = tl.sin(angle)
        slot = tl.load(slot_mapping_ptr + row)
        if EARLY_KV == 2:
            pdl.wait(PDL)
            pdl.launch_dependents(PDL)
        if rows != 1:   # not one query token: the prefill kernel's sequence
            return
        g = tl.arange(0, G_PAD)
        partner = (d + HALF) % HEAD_DIM
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
    if EARLY_KV == 0:
        slot = tl.load(slot_mapping_ptr + row)
    owner = hi == tl.cdiv(ctx, BLOCK_N)                  # the split whose last tile holds the new token
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
    if EARLY_KV == 0:
        bt_row = block_tables_ptr + b.to(tl.int64) * block_table_stride
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    if EARLY_KV == 0:
        for tile in range(lo, hi - owner.to(tl.int32)):
            acc, m_i, l_i = tiles.decode_tile(q, acc, m_i, l_i, tile, ctx, start, k_cache_ptr, v_cache_ptr,
                                              k_scale_ptr, v_scale_ptr, bt_row, kvh, d, qk_scale, 0.0, 0.0, 0.0, 0.0,
                                              PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, DOT_PRECISION, KV_QUANT,
                                              False, SOFTCAP)
        if owner:
            acc, m_i, l_i = tiles.decode_tile(q, acc, m_i, l_i, hi - 1, ctx, start, k_cache_ptr, v_cache_ptr,
                                              k_scale_ptr, v_scale_ptr, bt_row, kvh, d, qk_scale, new_k, new_v,
                                              new_k_scale, new_v_scale, PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N,
                                              DOT_PRECISION, KV_QUANT, True, SOFTCAP)
    else:
        # the prefetched tile lo first, WITH_NEW whichever tile it is (only the one holding ctx - 1 changes);
        # then the rest as above, the owner's last tile with the new token unless it was tile lo
        acc, m_i, l_i = tiles.decode_tile_math(q, acc, m_i, l_i, k0, v0, k0_scale, v0_scale, lo, ctx, start,
                                               qk_scale, new_k, new_v, new_k_scale, new_v_scale, BLOCK_N,
                                               DOT_PRECISION, KV_QUANT, True, SOFTCAP)
        for tile in range(lo + 1, hi - owner.to(tl.int32)):
            acc, m_i, l_i = tiles.decode_tile(q, acc, m_i, l_i, tile, ctx, start, k_cache_ptr, v_cache_ptr,
                                              k_scale_ptr, v_scale_ptr, bt_row, kvh, d, qk_scale, 0.0, 0.0, 0.0, 0.0,
                                              PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, DOT_PRECISION, KV_QUANT,
                                              False, SOFTCAP)
        if owner & (hi - 1 > lo):
            acc, m_i, l_i = tiles.decode_tile(q, acc, m_i, l_i, hi - 1, ctx, start, k_cache_ptr, v_cache_ptr,
                                              k_scale_ptr, v_scale_ptr, bt_row, kvh, d, qk_scale, new_k, new_v,
                                              new_k_scale, new_v_scale, PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N,
                                              DOT_PRECISION, KV_QUANT, True, SOFTCAP)
    tiles.finish_split(acc, m_i, l_i, out_ptr, part_acc_ptr, part_ml_ptr, counters_ptr, b, kvh, row, split,
                       num_splits, used, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, D_PAD, GROUP, G_PAD, GR_PAD,
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
def paged_prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                         query_start_loc_ptr, out_ptr, scale, sliding_window, block_table_stride,
                         skip_decode, k_scale_ptr, v_scale_ptr,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         D_PAD: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         KV_QUANT: tl.constexpr, PDL: tl.constexpr, SOFTCAP: tl.constexpr):
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
        acc, m_i, l_i = tiles.prefill_tile(q, acc, m_i, l_i, tile, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                           bt_row, kvh, d, q_pos, row_valid, last_pos, qk_scale, sliding_window,
                                           PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, DOT_PRECISION, False,
                                           KV_QUANT, SOFTCAP)
    for tile in range(masked_start, tl.cdiv(last_pos + 1, BLOCK_N)):
        acc, m_i, l_i = tiles.prefill_tile(q, acc, m_i, l_i, tile, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                           bt_row, kvh, d, q_pos, row_valid, last_pos, qk_scale, sliding_window,
                                           PAGE, NUM_KV_HEADS, HEAD_DIM, BLOCK_N, DOT_PRECISION, True,
                                           KV_QUANT, SOFTCAP)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & (d[None, :] < HEAD_DIM))
