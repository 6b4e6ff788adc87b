"""Rotary embedding of q and k fused with the write of k and v into the paged KV cache.

ONNX: ai.engc::RotaryKVWrite(qkv, positions, inv_freq, kv_cache, slot_mapping) -> q, attributes
num_heads, num_kv_heads, head_dim. Side effect: rotated k and v land in kv_cache at slot_mapping
(kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset;
a negative slot writes nothing). A quantized cache (int8 or float8_e4m3fn, engc build --kv-cache) has a
6th input, kv_scale [2, num_blocks, block_size, num_kv_heads] float32: each row of k and v is quantized
as it is written (kernels/kv_quant.py), its codes into kv_cache and its scale into kv_scale.
inv_freq is computed at build time (rope scaling is resolved there), so the op has one formula for all
families: the rotate-half (NeoX) layout that HF checkpoints use.
"""
import torch

from engc.kernels import kv_quant


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
                    num_heads: int, num_kv_heads: int, head_dim: int, kv_scale=None) -> torch.Tensor:
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos, sin = cos_sin(positions, inv_freq)
    q = rotate(q.reshape(t, num_heads, head_dim), cos, sin)
    k = rotate(k.reshape(t, num_kv_heads, head_dim), cos, sin)
    keep = slot_mapping >= 0  # a negative slot (a padded row) writes nothing
    slots = slot_mapping[keep]
    v = v.reshape(t, num_kv_heads, head_dim)
    for i, x in enumerate((k, v)):
        if kv_scale is None:
            kv_cache[i].view(-1, num_kv_heads, head_dim)[slots] = x[keep].to(kv_cache.dtype)
        else:
            codes, scales = kv_quant.quantize(x[keep], kv_cache.dtype)
            kv_cache[i].view(-1, num_kv_heads, head_dim)[slots] = codes
            kv_scale[i].view(-1, num_kv_heads)[slots] = scales
    return q.reshape(t, num_heads * head_dim)


def launch(qkv, positions, inv_freq, kv_cache, slot_mapping, q_out, consts=None, kv_scale=None):
    """Launch rule of rotary_kv_kernel: [(variant, grid, args)].

    qkv contiguous [T, (H + 2 KV) * D]; positions and slot_mapping [T], both int64 (variant 'pos_i64') or
    both int32 ('pos_i32'); inv_freq [D/2] float32; kv_cache contiguous [2, blocks, block_size, KV, D];
    q_out contiguous [T, H * D]. A negative slot skips the cache write for that token.
    args: qkv, positions, inv_freq, k_cache (kv_cache[0]), v_cache (kv_cache[1]), slot_mapping, q_out,
    global_scratch=0, profile_scratch=0. consts is unused.
    A quantized cache (int8/fp8 kv_cache with its float32 kv_scale [2, blocks, block_size, KV]) adds
    k_scale (kv_scale[0]), v_scale (kv_scale[1]) after q_out; the variant names are the same (a bundle
    holds one KV-cache format, its kernels specialized on it).
    """
    assert positions.dtype == slot_mapping.dtype and positions.dtype in (torch.int64, torch.int32)
    assert qkv.is_contiguous() and kv_cache.is_contiguous() and q_out.is_contiguous()
    assert inv_freq.dtype == torch.float32 and inv_freq.is_contiguous()
    assert (kv_scale is not None) == kv_quant.is_quantized(kv_cache.dtype)
    rows = qkv.numel() // qkv.shape[-1]
    if rows == 0:
        return []
    variant = "pos_i64" if positions.dtype == torch.int64 else "pos_i32"
    scales = [] if kv_scale is None else [kv_scale[0], kv_scale[1]]
    return [(variant, (rows, 1, 1),
             [qkv, positions, inv_freq, kv_cache[0], kv_cache[1], slot_mapping, q_out, *scales, 0, 0])]
