"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

ONNX: ai.engc::MLAAttention(q, ckv, kv_norm, positions, inv_freq, kv_cache, slot_mapping, block_tables,
                            context_lens, query_start_loc, w_uk, w_uv[, kv_scale]) -> out
  q [T, H * (nope + rope)]: each head's unrotated dims, then its rope dims (rotate-half order; the frontend
  permutes DeepSeek's interleaved pairs into it); ckv [T, R + rope]: kv_a_proj_with_mqa's output, the latent
  (kv_lora_rank R values, normed here with kv_norm and eps) then the shared rope key; inv_freq [rope / 2].
  kv_cache [1, num_blocks, block_size, 1, R + rope]: per token the normed latent then the rotated rope key,
  written at slot_mapping (a negative slot writes nothing). w_uk [H, nope, R] and w_uv [H, v, R]: kv_b_proj
  split per head at build time, the key and the value up-projections. out [T, H * v].
  A quantized cache (--kv-cache int8|fp8) adds kv_scale [1, num_blocks, block_size, 1]: one scale a token's row.
Attributes: num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale (q.k's, YaRN's
mscale folded in), eps.

Two forms compute the same attention (sequences as PagedAttention's: query_start_loc, context_lens):
- absorbed: q_nope @ w_uk gives each head a query in latent space, scored against the cached rows as they
  are (one shared "KV head" R + rope wide), and the latent output @ w_uv.T is the head's value. Its cost
  grows with query rows x context x R, so it is decode's form.
- decompressed: the context's latents up-projected to per-head keys and values (context x H x (nope + v) x R
  once), then ordinary attention: cheaper once a sequence has many query rows (absorbs()).
"""
from __future__ import annotations

import torch

from engc.kernels import kv_quant, rotary
from engc.kernels.paged_attention import sequence_spans
from engc.kernels.rms_norm import rms_norm


def absorbs(query_rows: int, kv_lora_rank: int, nope: int, v: int) -> bool:
    """Whether the absorbed form costs less for a sequence with query_rows rows: it scores and sums over
    2R + rope values a (row, key) where the decompressed form uses nope + rope + v, but skips up-projecting
    every context token (R x (nope + v) a token and head)."""
    return query_rows * (2 * kv_lora_rank - nope - v) <= kv_lora_rank * (nope + v)


def write_latent(ckv, kv_norm, positions, inv_freq, kv_cache, slot_mapping, kv_lora_rank: int, eps: float,
                 kv_scale=None) -> torch.Tensor:
    """Norms the latent, rotates the rope key, writes both as one row a token; returns the rows [T, R + rope]."""
    latent = rms_norm(ckv[:, :kv_lora_rank], kv_norm, eps)
    cos, sin = rotary.cos_sin(positions, inv_freq)
    k_pe = rotary.rotate(ckv[:, None, kv_lora_rank:], cos, sin)[:, 0]
    rows = torch.cat([latent, k_pe], dim=-1)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = kv_cache.view(-1, rows.shape[1])
    if kv_scale is None:
        flat[slots] = rows[keep].to(kv_cache.dtype)
    else:
        codes, scales = kv_quant.quantize(rows[keep], kv_cache.dtype)
        flat[slots] = codes
        kv_scale.view(-1)[slots] = scales
    return rows


def gather_rows(kv_cache, block_table, context_len: int, kv_scale=None) -> torch.Tensor:
    """The cached rows [context_len, R + rope] of one sequence, in float32."""
    block_size = kv_cache.shape[2]
    blocks = block_table[:(context_len + block_size - 1) // block_size].long()
    rows = kv_cache[0, blocks].flatten(0, 1)[:context_len, 0]
    if kv_scale is not None:
        return kv_quant.dequantize(rows, kv_scale[0, blocks].flatten(0, 1)[:context_len, 0])
    return rows.float()


def rotated_query(q, positions, inv_freq, num_heads: int, nope: int, rope: int):
    """q [T, H * (nope + rope)] -> (q_nope [T, H, nope], rotated q_pe [T, H, rope]), float32."""
    q = q.reshape(q.shape[0], num_heads, nope + rope)
    cos, sin = rotary.cos_sin(positions, inv_freq)
    return q[..., :nope].float(), rotary.rotate(q[..., nope:], cos, sin).float()


def _causal(n: int, ctx: int, device) -> torch.Tensor:
    return torch.arange(ctx, device=device)[None, :] <= torch.arange(ctx - n, ctx, device=device)[:, None]


def attend_absorbed(q_nope, q_pe, rows, w_uk, w_uv, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """One sequence's n query rows over its ctx cached rows, absorbed: -> [n, H, v] float32."""
    q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_uk.float())
    scores = (torch.einsum("nhr,cr->hnc", q_lat, rows[:, :kv_lora_rank])
              + torch.einsum("nhd,cd->hnc", q_pe, rows[:, kv_lora_rank:])) * scale
    scores = scores.masked_fill(~_causal(q_nope.shape[0], rows.shape[0], rows.device), float("-inf"))
    o_lat = torch.einsum("hnc,cr->nhr", torch.softmax(scores, dim=-1), rows[:, :kv_lora_rank])
    return torch.einsum("nhr,hvr->nhv", o_lat, w_uv.float())


def attend_decompressed(q_nope, q_pe, rows, w_uk, w_uv, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """The same attention with the context's keys and values up-projected per head: -> [n, H, v] float32."""
    latent = rows[:, :kv_lora_rank]
    k_nope = torch.einsum("cr,hdr->hcd", latent, w_uk.float())
    v = torch.einsum("cr,hvr->hcv", latent, w_uv.float())
    scores = (torch.einsum("nhd,hcd->hnc", q_nope, k_nope)
              + torch.einsum("nhd,cd->hnc", q_pe, rows[:, kv_lora_rank:])) * scale
    scores = scores.masked_fill(~_causal(q_nope.shape[0], rows.shape[0], rows.device), float("-inf"))
    return torch.einsum("hnc,hcv->nhv", torch.softmax(scores, dim=-1), v)


def attend_decompressed_batched(q_nope, q_pe, kv_cache, block_tables, context_lens, query_start_loc, w_uk, w_uv,
                                scale: float, kv_lora_rank: int, max_query_len: int, kv_scale=None) -> torch.Tensor:
    """The decompressed form for a whole step as a few batched torch ops (the GPU's prefill: cuBLAS for the
    up-projections, SDPA's fused attention), with nothing that waits on the GPU: every sequence's blocks
    gathered and up-projected, its rows padded to max_query_len, masked causally. -> [T, H, v] in q's dtype.
    The padding costs block_tables' width of keys a sequence; prefill steps are few and wide, so it pays."""
    t, heads = q_nope.shape[0], q_nope.shape[1]
    seqs, width = block_tables.shape
    page, dtype = kv_cache.shape[2], w_uk.dtype
    blocks = block_tables.long()
    rows = kv_cache[0, blocks].reshape(seqs, width * page, -1)
    if kv_scale is not None:
        rows = kv_quant.dequantize(rows, kv_scale[0, blocks].reshape(seqs, width * page))
    rows = rows.to(dtype)
    latent, k_pe = rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]
    k = torch.cat([torch.einsum("blr,hdr->bhld", latent, w_uk),
                   k_pe[:, None].expand(-1, heads, -1, -1)], dim=-1)
    v = torch.einsum("blr,hvr->bhlv", latent, w_uv)
    starts = query_start_loc.long()
    row_seq = row_sequences(query_start_loc, t)
    offset = torch.arange(t, device=q_nope.device) - starts[row_seq]
    q = q_nope.new_zeros(seqs, max_query_len, heads, k.shape[-1])
    q[row_seq, offset] = torch.cat([q_nope, q_pe], dim=-1)
    q_pos = (context_lens.long() - (starts[1:seqs + 1] - starts[:seqs]))[:, None] + \
        torch.arange(max_query_len, device=q.device)[None]
    visible = torch.arange(width * page, device=q.device)[None, None] <= q_pos[:, :, None]
    out = torch.nn.functional.scaled_dot_product_attention(q.to(dtype).transpose(1, 2), k, v,
                                                           attn_mask=visible[:, None], scale=scale)
    return out.transpose(1, 2)[row_seq, offset]


def row_sequences(query_start_loc, t: int) -> torch.Tensor:
    """The sequence of each of the step's t query rows (int64), without a host round trip."""
    seqs = query_start_loc.numel() - 1
    return torch.searchsorted(query_start_loc[1:].to(torch.int64), torch.arange(t, device=query_start_loc.device),
                              right=True).clamp(max=max(seqs - 1, 0))


def mla_attention(q, ckv, kv_norm, positions, inv_freq, kv_cache, slot_mapping, block_tables, context_lens,
                  query_start_loc, w_uk, w_uv, kv_scale=None, *, num_heads: int, kv_lora_rank: int,
                  qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, scale: float, eps: float):
    """The reference: each sequence in the form absorbs() picks for its query rows."""
    write_latent(ckv, kv_norm, positions, inv_freq, kv_cache, slot_mapping, kv_lora_rank, eps, kv_scale)
    q_nope, q_pe = rotated_query(q, positions, inv_freq, num_heads, qk_nope_head_dim, qk_rope_head_dim)
    out = q.new_zeros(q.shape[0], num_heads * v_head_dim)
    for b, qs, qe, ctx in sequence_spans(block_tables, context_lens, query_start_loc):
        rows = gather_rows(kv_cache, block_tables[b], ctx, kv_scale)
        form = attend_absorbed if absorbs(qe - qs, kv_lora_rank, qk_nope_head_dim, v_head_dim) \
            else attend_decompressed
        o = form(q_nope[qs:qe], q_pe[qs:qe], rows, w_uk, w_uv, scale, kv_lora_rank)
        out[qs:qe] = o.reshape(qe - qs, -1).to(q.dtype)
    return out


# ---- the GPU path: the absorbed form's Triton kernels over the latent cache ------------------------------

def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def splits_for(num_rows: int, max_context_len: int, consts: dict) -> int:
    """KV splits a query row's context is cut into: enough programs for the GPU at decode's few rows, none
    shorter than min_split_tokens; prefill rows (many) take one."""
    c = consts["decode"]
    by_len = max(1, max_context_len // c["min_split_tokens"])
    return max(1, min(c["max_splits"], by_len, _cdiv(c["target_programs"], max(num_rows, 1))))


def launch(q_abs, kv_cache, block_tables, context_lens, query_start_loc, row_seq, partial, lse, o_lat, *,
           splits: int, scale: float, consts: dict, kv_scale=None):
    """mla_decode_kernel then mla_reduce_kernel.

    q_abs [T, H, R + rope] (each head's absorbed latent query, then its rotated rope query), kv_cache as the
    op's, row_seq [T] int32 (the sequence of each query row), partial [T, H, splits, R] float32 and lse
    [T, H, splits] float32 (each split's normalized output and log-sum-exp), o_lat [T, H, R] (model dtype).
    Row t of sequence b sees the first context_lens[b] - (query_start_loc[b + 1] - 1 - t) cached tokens, so
    one kernel serves decode (one row a sequence, split-KV) and prefill/extend (causal rows).
    decode args: q_abs, kv_cache, kv_scale (any tensor without one), block_tables, context_lens,
    query_start_loc, row_seq, partial, lse, scale, max_blocks, splits, scratch, scratch.
    reduce args: partial, lse, o_lat, splits, scratch, scratch."""
    t, h = q_abs.shape[0], q_abs.shape[1]
    if t == 0:
        return []
    block_h = consts["decode"]["BLOCK_H"]
    return [("decode", (t, _cdiv(h, block_h), splits),
             [q_abs, kv_cache, kv_cache if kv_scale is None else kv_scale, block_tables, context_lens,
              query_start_loc, row_seq, partial, lse, float(scale), block_tables.shape[1], splits, 0, 0]),
            ("reduce", (t, h, 1), [partial, lse, o_lat, splits, 0, 0])]


def launch_query(q, positions, inv_freq, w_uk, query_start_loc, q_abs, row_seq, *, consts: dict):
    """mla_query_kernel, grid (row blocks, heads, latent blocks): q [T, H * (nope + rope)] -> q_abs [T, H, R + rope]
    (q_nope @ w_uk per head, then the rotated rope query) and row_seq [T] int32. positions int64.
    args: q, positions, inv_freq, w_uk, query_start_loc, q_abs, row_seq, num_rows, num_seqs, scratch, scratch."""
    t, heads, r = q_abs.shape[0], q_abs.shape[1], w_uk.shape[2]
    if t == 0:
        return []
    c = consts["query"]
    return [("query", (_cdiv(t, c["BLOCK_T"]), heads, _cdiv(r, c["BLOCK_R"])),
             [q, positions, inv_freq, w_uk, query_start_loc, q_abs, row_seq, t, query_start_loc.shape[0] - 1, 0, 0])]


def launch_write(ckv, kv_norm, positions, inv_freq, slot_mapping, kv_cache, eps: float, kv_scale=None):
    """mla_write_kernel, grid (T,): each token's latent normed and rope key rotated into its cache row.
    positions and slot_mapping int64. args: ckv, kv_norm, positions, inv_freq, slot_mapping, kv_cache, kv_scale
    (any tensor without one), eps, scratch, scratch."""
    if ckv.shape[0] == 0:
        return []
    return [("write", (ckv.shape[0], 1, 1), [ckv, kv_norm, positions, inv_freq, slot_mapping, kv_cache,
                                             kv_cache if kv_scale is None else kv_scale, float(eps), 0, 0])]


def forward(run, q, ckv, kv_norm, positions, inv_freq, kv_cache, slot_mapping, block_tables, context_lens,
            query_start_loc, w_uk, w_uv, kv_scale=None, *, num_heads: int, kv_lora_rank: int,
            qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, scale: float, eps: float,
            max_context_len: int | None, consts: dict, max_query_len: int = 1) -> torch.Tensor:
    """The node on the GPU: the cache write (a kernel: a padded row's negative slot must write nothing, which
    torch could only do by a masked index that waits on the GPU), the query kernel (q's absorption into the
    latent, its rope, each row's sequence), the attention kernels, and the value up-projection (bmm).
    run(launches) runs a launch rule's output (BundleKernels, or the interpreter in the tests). Nothing here
    waits on the GPU, so a CUDA graph can hold it. A step whose longest query (max_query_len, the host's)
    absorbs() would not take takes the decompressed form instead."""
    t = q.shape[0]
    if max_context_len is None:   # a CUDA graph's capture: the block table's capacity
        max_context_len = block_tables.shape[1] * kv_cache.shape[2]
    positions = positions.to(torch.int64)
    run(launch_write(ckv, kv_norm, positions, inv_freq, slot_mapping.to(torch.int64), kv_cache, eps, kv_scale))
    if not absorbs(max_query_len, kv_lora_rank, qk_nope_head_dim, v_head_dim):   # a long prefill
        q_nope, q_pe = rotated_query(q, positions, inv_freq, num_heads, qk_nope_head_dim, qk_rope_head_dim)
        tables = block_tables[:, :_cdiv(max_context_len, kv_cache.shape[2])]   # no key past the longest context
        o = attend_decompressed_batched(q_nope.to(q.dtype), q_pe.to(q.dtype), kv_cache, tables, context_lens,
                                        query_start_loc, w_uk, w_uv, scale, kv_lora_rank, max_query_len, kv_scale)
        return o.reshape(t, num_heads * v_head_dim).to(q.dtype).contiguous()
    q_abs = torch.empty(t, num_heads, kv_lora_rank + qk_rope_head_dim, dtype=q.dtype, device=q.device)
    row_seq = torch.empty(t, dtype=torch.int32, device=q.device)
    run(launch_query(q, positions, inv_freq, w_uk, query_start_loc, q_abs, row_seq, consts=consts))
    splits = splits_for(t, max_context_len, consts)
    partial = torch.empty(t, num_heads, splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.empty(t, num_heads, splits, dtype=torch.float32, device=q.device)
    o_lat = torch.empty(t, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    run(launch(q_abs, kv_cache, block_tables, context_lens, query_start_loc, row_seq, partial, lse, o_lat,
               splits=splits, scale=scale, consts=consts, kv_scale=kv_scale))
    # the value up-projection per head, written straight into [T, H, v] rows (the output's transposed view is a
    # strided batch cuBLAS writes as it is, so no copy kernel follows)
    out = torch.empty(t, num_heads, v_head_dim, dtype=q.dtype, device=q.device)
    torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
    return out.reshape(t, num_heads * v_head_dim)
