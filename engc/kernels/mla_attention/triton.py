"""Triton kernels of MLAAttention's absorbed form over the paged latent cache (launch rules in __init__.py).

mla_decode_kernel: one program per (query row, block of BLOCK_H heads, KV split). Every head of a row reads the
same cached rows (one latent "KV head"), so a program scores BLOCK_H heads against each BLOCK_N-token tile
with two dots, latent (R wide) and rope key (ROPE wide), and sums the tile's latents as values: one read of
the cache serves all the heads in the block. Each split writes its output normalized by its own sum and the
log-sum-exp; mla_reduce_kernel weighs the splits together. Rows past the first of a sequence see fewer keys
(causal), so the same kernel serves decode (one row, split-KV) and prefill/extend rows.

mla_query_kernel makes the decode kernel's query in one launch where torch would take about twenty small
ones: each head's q_nope times its w_uk (a BLOCK_T x BLOCK_R tile of the latent query per program), the rope
dims rotated, and each row's sequence found in query_start_loc.
"""
import triton
import triton.language as tl


@triton.jit
def mla_decode_kernel(q_ptr, cache_ptr, kv_scale_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
                      row_seq_ptr, partial_ptr, lse_ptr, scale, block_table_stride, num_splits,
                      NUM_HEADS: tl.constexpr, R: tl.constexpr, ROPE: tl.constexpr, R_PAD: tl.constexpr,
                      ROPE_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                      KV_QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    row = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(row_seq_ptr + row)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    visible = tl.load(context_lens_ptr + seq) - (q_end - 1 - row)
    per_split = tl.cdiv(tl.cdiv(visible, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, visible)

    W: tl.constexpr = R + ROPE
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < NUM_HEADS
    dr = tl.arange(0, R_PAD)
    dp = tl.arange(0, ROPE_PAD)
    q_row = q_ptr + (row * NUM_HEADS + heads[:, None]).to(tl.int64) * W
    q_lat = tl.load(q_row + dr[None, :], mask=h_ok[:, None] & (dr < R)[None, :], other=0.0)
    q_pe = tl.load(q_row + R + dp[None, :], mask=h_ok[:, None] & (dp < ROPE)[None, :], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        t_ok = toks < end
        block = tl.load(table + toks // PAGE, mask=t_ok, other=0)
        slot = block.to(tl.int64) * PAGE + toks % PAGE
        k_lat = tl.load(cache_ptr + slot[:, None] * W + dr[None, :], mask=t_ok[:, None] & (dr < R)[None, :],
                        other=0.0)
        k_pe = tl.load(cache_ptr + slot[:, None] * W + R + dp[None, :], mask=t_ok[:, None] & (dp < ROPE)[None, :],
                       other=0.0)
        if KV_QUANT:   # one float32 scale a token's row (kernels/kv_quant.py)
            row_scale = tl.load(kv_scale_ptr + slot, mask=t_ok, other=0.0)
            k_lat = (k_lat.to(tl.float32) * row_scale[:, None]).to(q_lat.dtype)
            k_pe = (k_pe.to(tl.float32) * row_scale[:, None]).to(q_pe.dtype)
        scores = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PRECISION)
        scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        scores = tl.where(t_ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        s = s * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=DOT_PRECISION)
        m = m_new

    has_keys = start < end   # a split past the row's keys: weight 0 in the reduce
    out = tl.where(has_keys, acc / tl.maximum(s, 1e-30)[:, None], 0.0)
    lse = tl.where(has_keys, m + tl.log(tl.maximum(s, 1e-30)), float("-inf"))
    part = (row * NUM_HEADS + heads).to(tl.int64) * num_splits + split
    tl.store(partial_ptr + part[:, None] * R + dr[None, :], out, mask=h_ok[:, None] & (dr < R)[None, :])
    tl.store(lse_ptr + part, lse, mask=h_ok)


@triton.jit
def mla_reduce_kernel(partial_ptr, lse_ptr, out_ptr, num_splits, NUM_HEADS: tl.constexpr, R: tl.constexpr,
                      R_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    base = (row * NUM_HEADS + head).to(tl.int64)
    sp = tl.arange(0, MAX_SPLITS)
    sp_ok = sp < num_splits
    lse = tl.load(lse_ptr + base * num_splits + sp, mask=sp_ok, other=float("-inf"))
    w = tl.where(sp_ok & (lse > float("-inf")), tl.exp(lse - tl.max(lse, 0)), 0.0)
    w = w / tl.maximum(tl.sum(w, 0), 1e-30)   # a padding row has no keys: zeros, not NaN
    dr = tl.arange(0, R_PAD)
    parts = tl.load(partial_ptr + (base * num_splits + sp[:, None]) * R + dr[None, :],
                    mask=sp_ok[:, None] & (dr < R)[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0)
    tl.store(out_ptr + base * R + dr, out.to(out_ptr.dtype.element_ty), mask=dr < R)


@triton.jit
def mla_write_kernel(ckv_ptr, kv_norm_ptr, positions_ptr, inv_freq_ptr, slot_mapping_ptr, cache_ptr, kv_scale_ptr,
                     eps, R: tl.constexpr, ROPE: tl.constexpr, R_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                     KV_QUANT: tl.constexpr):
    """One token's cache row: the latent RMS-normed (float32, rounded as the reference rounds), the rope key
    rotated; codes and one scale for the whole row in a quantized cache. A negative slot writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    if slot >= 0:
        W: tl.constexpr = R + ROPE
        HALF: tl.constexpr = ROPE // 2
        src = ckv_ptr + t.to(tl.int64) * W
        dst = cache_ptr + slot * W
        dr = tl.arange(0, R_PAD)
        r_ok = dr < R
        raw = tl.load(src + dr, mask=r_ok, other=0.0)
        x = raw.to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, 0) / R + eps)
        w = tl.load(kv_norm_ptr + dr, mask=r_ok, other=0.0)
        latent = (w.to(tl.float32) * y.to(raw.dtype).to(tl.float32)).to(raw.dtype).to(tl.float32)
        d = tl.arange(0, HALF_PAD)
        d_ok = d < HALF
        angle = tl.load(positions_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + d, mask=d_ok, other=0.0)
        cos, sin = tl.cos(angle), tl.sin(angle)
        k1 = tl.load(src + R + d, mask=d_ok, other=0.0).to(tl.float32)
        k2 = tl.load(src + R + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
        o1 = (k1 * cos - k2 * sin).to(raw.dtype).to(tl.float32)
        o2 = (k2 * cos + k1 * sin).to(raw.dtype).to(tl.float32)
        if KV_QUANT:   # kernels/kv_quant.py: scale = absmax / QMAX over the row, codes = row / scale
            QMAX: tl.constexpr = 127.0 if KV_QUANT == 1 else 448.0
            amax = tl.maximum(tl.max(tl.abs(latent), 0), tl.maximum(tl.max(tl.abs(o1), 0), tl.max(tl.abs(o2), 0)))
            inv = tl.where(amax > 0, QMAX / amax, 0.0)
            latent = tl.minimum(tl.maximum(latent * inv, -QMAX), QMAX)
            o1 = tl.minimum(tl.maximum(o1 * inv, -QMAX), QMAX)
            o2 = tl.minimum(tl.maximum(o2 * inv, -QMAX), QMAX)
            if KV_QUANT == 1:
                latent = tl.minimum(tl.floor(latent + 0.5), QMAX)
                o1 = tl.minimum(tl.floor(o1 + 0.5), QMAX)
                o2 = tl.minimum(tl.floor(o2 + 0.5), QMAX)
            tl.store(kv_scale_ptr + slot, amax / QMAX)
        tl.store(dst + dr, latent.to(cache_ptr.dtype.element_ty), mask=r_ok)
        tl.store(dst + R + d, o1.to(cache_ptr.dtype.element_ty), mask=d_ok)
        tl.store(dst + R + HALF + d, o2.to(cache_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def mla_query_kernel(q_ptr, positions_ptr, inv_freq_ptr, w_uk_ptr, query_start_loc_ptr, q_abs_ptr, row_seq_ptr,
                     num_rows, num_seqs, NUM_HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
                     R: tl.constexpr, NOPE_PAD: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program (row block, head, latent block): q_abs[rows, head, block] = q_nope @ w_uk[head][:, block]; the
    first latent block's programs also write the head's rotated rope query (rounded as rotary.rotate rounds)
    and head 0's the rows' sequences (searchsorted over query_start_loc[1:], clamped to the last)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    r_block = tl.program_id(2)
    ok = rows < num_rows
    QW: tl.constexpr = NOPE + ROPE
    W: tl.constexpr = R + ROPE
    src = q_ptr + rows[:, None].to(tl.int64) * (NUM_HEADS * QW) + head * QW
    dst = q_abs_ptr + (rows[:, None].to(tl.int64) * NUM_HEADS + head) * W
    dn = tl.arange(0, NOPE_PAD)
    n_ok = dn < NOPE
    q_nope = tl.load(src + dn[None, :], mask=ok[:, None] & n_ok[None, :], other=0.0)
    dr = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = dr < R
    w = tl.load(w_uk_ptr + (head * NOPE + dn[:, None]).to(tl.int64) * R + dr[None, :],
                mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    q_lat = tl.dot(q_nope, w, input_precision=DOT_PRECISION)
    tl.store(dst + dr[None, :], q_lat.to(q_abs_ptr.dtype.element_ty), mask=ok[:, None] & r_ok[None, :])
    if r_block == 0:
        HALF: tl.constexpr = ROPE // 2
        d = tl.arange(0, HALF_PAD)
        pe_ok = ok[:, None] & (d < HALF)[None, :]
        pos = tl.load(positions_ptr + rows, mask=ok, other=0).to(tl.float32)
        angle = pos[:, None] * tl.load(inv_freq_ptr + d, mask=d < HALF, other=0.0)[None, :]
        cos, sin = tl.cos(angle), tl.sin(angle)
        x1 = tl.load(src + NOPE + d[None, :], mask=pe_ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + NOPE + HALF + d[None, :], mask=pe_ok, other=0.0).to(tl.float32)
        tl.store(dst + R + d[None, :], (x1 * cos - x2 * sin).to(q_abs_ptr.dtype.element_ty), mask=pe_ok)
        tl.store(dst + R + HALF + d[None, :], (x2 * cos + x1 * sin).to(q_abs_ptr.dtype.element_ty), mask=pe_ok)
        if head == 0:
            seq = tl.zeros([BLOCK_T], tl.int32)
            for s0 in range(0, num_seqs, BLOCK_S):
                s = s0 + tl.arange(0, BLOCK_S)
                ends = tl.load(query_start_loc_ptr + 1 + s, mask=s < num_seqs, other=2147483647)
                seq += tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), 1)
            tl.store(row_seq_ptr + rows, tl.minimum(seq, tl.maximum(num_seqs - 1, 0)), mask=ok)
