"""Rotary and attention for a bfloat16 or float16 bundle on the CPU, rounded as HF transformers rounds them
(the HALF_OPS of rotary/bind.py and paged_attention/bind.py).

The references (kernels/<op>) compute rotary and attention in float32 and round once at the end, as the
GPU kernels do, and stay the kernels' test oracles. A half-precision model on the CPU should instead give
what HF transformers gives for it on the CPU, token for token: there the rotary's cos and sin are rounded
to the model dtype and each product and the sum are rounded (apply_rotary_pos_emb), and attention is
torch's scaled_dot_product_attention on half-precision tensors (HF's default "sdpa" attention), whose CPU
kernel rounds the softmax's weights to the model dtype before they meet V. In a 30-layer model those
one-ulp differences change greedy tokens. Norms, SiLU and the projections already round as HF does.
A quantized KV cache (--kv-cache) has no HF counterpart: its ops keep the references.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engc.kernels import rotary as rotary_ref
from engc.kernels.paged_attention import gather_kv, sequence_spans
from engc.kernels.paged_attention import paged_attention as paged_attention_ref


def rotate_rounded(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb on x [T, heads, D] with float32 cos, sin: everything in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def rotary_kv_write(qkv, positions, inv_freq, kv_cache, slot_mapping, num_heads: int, num_kv_heads: int,
                    head_dim: int, kv_scale=None) -> torch.Tensor:
    """kernels/rotary.rotary_kv_write with HF's roundings."""
    if kv_scale is not None:
        return rotary_ref.rotary_kv_write(qkv, positions, inv_freq, kv_cache, slot_mapping, num_heads,
                                          num_kv_heads, head_dim, kv_scale=kv_scale)
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos, sin = rotary_ref.cos_sin(positions, inv_freq)
    q = rotate_rounded(q.reshape(t, num_heads, head_dim), cos, sin)
    k = rotate_rounded(k.reshape(t, num_kv_heads, head_dim), cos, sin)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for i, x in enumerate((k, v.reshape(t, num_kv_heads, head_dim))):
        kv_cache[i].view(-1, num_kv_heads, head_dim)[slots] = x[keep].to(kv_cache.dtype)
    return q.reshape(t, num_heads * head_dim)


def _visible(n: int, ctx: int, sliding_window: int, device) -> torch.Tensor | None:
    """The [n, ctx] mask of a sequence's last n queries over its ctx keys; None where sdpa's own causal
    rule (or no mask, for one query) is the same: a whole prompt, a single new token, no window."""
    if not sliding_window and (n == 1 or n == ctx):
        return None
    q_pos = torch.arange(ctx - n, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window:
        visible &= k_pos > q_pos - sliding_window
    return visible


def paged_attention(q, kv_cache, block_tables, context_lens, query_start_loc, num_heads: int,
                    num_kv_heads: int, head_dim: int, scale: float, sliding_window: int = 0,
                    kv_scale=None, softcap: float = 0.0) -> torch.Tensor:
    """kernels/paged_attention.paged_attention as HF's sdpa attention computes it: one
    scaled_dot_product_attention call a sequence, in the model dtype, with the arguments HF passes.
    Soft-capped scores (Gemma 2, which HF runs in its eager attention): _eager_softcapped."""
    if kv_scale is not None:
        return paged_attention_ref(q, kv_cache, block_tables, context_lens, query_start_loc, num_heads,
                                   num_kv_heads, head_dim, scale, sliding_window, kv_scale=kv_scale, softcap=softcap)
    if softcap:
        return _eager_softcapped(q, kv_cache, block_tables, context_lens, query_start_loc, num_heads,
                                 num_kv_heads, head_dim, scale, sliding_window, softcap)
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    for b, qs, qe, ctx in sequence_spans(block_tables, context_lens, query_start_loc):
        n = qe - qs
        k, v = gather_kv(kv_cache, block_tables[b], ctx)
        qb = q[qs:qe].reshape(n, num_heads, head_dim).transpose(0, 1)[None]    # [1, H, n, D]
        k, v = (x.to(q.dtype).transpose(0, 1)[None] for x in (k, v))             # [1, KV, ctx, D]
        mask = _visible(n, ctx, sliding_window, q.device)
        if mask is None:
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=n > 1, scale=scale, enable_gqa=group > 1)
        else:  # HF repeats the KV heads itself when it passes a mask
            k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
        out[qs:qe] = o[0].transpose(0, 1).reshape(n, num_heads * head_dim)
    return out


def _eager_softcapped(q, kv_cache, block_tables, context_lens, query_start_loc, num_heads, num_kv_heads,
                      head_dim, scale, sliding_window, softcap) -> torch.Tensor:
    """HF's eager attention with soft-capping: scores, scale and cap in the model dtype, softmax in float32
    rounded back to the model dtype, then the product with v in the model dtype."""
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    for b, qs, qe, ctx in sequence_spans(block_tables, context_lens, query_start_loc):
        n = qe - qs
        k, v = gather_kv(kv_cache, block_tables[b], ctx)
        qb = q[qs:qe].reshape(n, num_heads, head_dim).transpose(0, 1)                 # [H, n, D]
        k, v = (x.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))
        scores = torch.tanh(torch.matmul(qb, k.transpose(1, 2)) * scale / softcap) * softcap
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - sliding_window) if sliding_window else True)
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[qs:qe] = torch.matmul(weights, v).transpose(0, 1).reshape(n, num_heads * head_dim)
    return out


def rotary_paged_attention(qkv, positions, inv_freq, kv_cache, slot_mapping, block_tables, context_lens,
                           query_start_loc, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                           sliding_window: int = 0, kv_scale=None, softcap: float = 0.0) -> torch.Tensor:
    q = rotary_kv_write(qkv, positions, inv_freq, kv_cache, slot_mapping, num_heads, num_kv_heads, head_dim,
                        kv_scale=kv_scale)
    return paged_attention(q, kv_cache, block_tables, context_lens, query_start_loc, num_heads, num_kv_heads,
                           head_dim, scale, sliding_window, kv_scale=kv_scale, softcap=softcap)
