"""Causal attention of a flat batch of query tokens over the paged KV cache (prefill, extend and decode).

ONNX: ai.engc::PagedAttention(q, kv_cache, block_tables, context_lens, query_start_loc) -> out,
attributes num_heads, num_kv_heads, head_dim, scale, sliding_window (0 = none).
Sequence b owns query rows query_start_loc[b]:query_start_loc[b+1]; they are the last tokens of its
context of context_lens[b] tokens, whose keys are in the blocks listed by block_tables[b]. A query at
absolute position p sees keys at positions (p - sliding_window, p]. GQA: query head h reads KV head
h // (num_heads // num_kv_heads).
"""
import torch


def gather_kv(kv_cache, block_table, context_len: int):
    block_size = kv_cache.shape[2]
    n_blocks = (context_len + block_size - 1) // block_size
    blocks = block_table[:n_blocks].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:context_len]
    v = kv_cache[1, blocks].flatten(0, 1)[:context_len]
    return k, v  # [context_len, num_kv_heads, head_dim]


def paged_attention(q, kv_cache, block_tables, context_lens, query_start_loc,
                    num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                    sliding_window: int = 0) -> torch.Tensor:
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    for b in range(block_tables.shape[0]):
        qs, qe = int(query_start_loc[b]), int(query_start_loc[b + 1])
        ctx = int(context_lens[b])
        if qe == qs:
            continue
        k, v = gather_kv(kv_cache, block_tables[b], ctx)
        qb = q[qs:qe].reshape(qe - qs, num_heads, head_dim).float().transpose(0, 1)  # [H, n, D]
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)                 # [H, ctx, D]
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qb @ k.transpose(1, 2)) * scale
        q_pos = torch.arange(ctx - (qe - qs), ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        visible = k_pos <= q_pos
        if sliding_window:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v                                         # [H, n, D]
        out[qs:qe] = o.transpose(0, 1).reshape(qe - qs, num_heads * head_dim).to(q.dtype)
    return out
