"""Rotary embedding of q and k fused with the write of k and v into the paged KV cache.

ONNX: ai.engc::RotaryKVWrite(qkv, positions, inv_freq, kv_cache, slot_mapping) -> q, attributes
num_heads, num_kv_heads, head_dim. Side effect: rotated k and v land in kv_cache at slot_mapping
(kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset).
inv_freq is computed at build time (rope scaling is resolved there), so the op has one formula for all
families: the rotate-half (NeoX) layout that HF checkpoints use.
"""
import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor):
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # broadcast over heads
    return emb.cos(), emb.sin()


def rotary_kv_write(qkv, positions, inv_freq, kv_cache, slot_mapping,
                    num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos, sin = cos_sin(positions, inv_freq)
    q = rotate(q.reshape(t, num_heads, head_dim), cos, sin)
    k = rotate(k.reshape(t, num_kv_heads, head_dim), cos, sin)
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = k.to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = v.reshape(t, num_kv_heads, head_dim).to(kv_cache.dtype)
    return q.reshape(t, num_heads * head_dim)
