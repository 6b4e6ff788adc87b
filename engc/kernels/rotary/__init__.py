"""Rotary embedding of q and k fused with the write of k and v into the paged KV cache.

ONNX: ai.engc::RotaryKVWrite(qkv, positions, inv_freq, kv_cache, slot_mapping) -> q, attributes
num_heads, num_kv_heads, head_dim. Side effect: rotated k and v land in kv_cache at slot_mapping
(kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset;
a negative slot writes nothing).
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
    keep = slot_mapping >= 0  # a negative slot (a padded row) writes nothing
    slots = slot_mapping[keep]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = v.reshape(t, num_kv_heads, head_dim)[keep].to(kv_cache.dtype)
    return q.reshape(t, num_heads * head_dim)


def launch(qkv, positions, inv_freq, kv_cache, slot_mapping, q_out, consts=None):
    """Launch rule of rotary_kv_kernel: [(variant, grid, args)].

    qkv contiguous [T, (H + 2 KV) * D]; positions and slot_mapping [T], both int64 (variant 'pos_i64') or
    both int32 ('pos_i32'); inv_freq [D/2] float32; kv_cache contiguous [2, blocks, block_size, KV, D];
    q_out contiguous [T, H * D]. A negative slot skips the cache write for that token.
    args: qkv, positions, inv_freq, k_cache (kv_cache[0]), v_cache (kv_cache[1]), slot_mapping, q_out,
    global_scratch=0, profile_scratch=0. consts is unused.
    """
    assert positions.dtype == slot_mapping.dtype and positions.dtype in (torch.int64, torch.int32)
    assert qkv.is_contiguous() and kv_cache.is_contiguous() and q_out.is_contiguous()
    assert inv_freq.dtype == torch.float32 and inv_freq.is_contiguous()
    rows = qkv.numel() // qkv.shape[-1]
    if rows == 0:
        return []
    variant = "pos_i64" if positions.dtype == torch.int64 else "pos_i32"
    return [(variant, (rows, 1, 1),
             [qkv, positions, inv_freq, kv_cache[0], kv_cache[1], slot_mapping, q_out, 0, 0])]
