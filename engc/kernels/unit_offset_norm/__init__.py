"""Gemma's RMSNorm, which scales by (1 + weight), for half-precision bundles: the named variants
RMSNormUnitOffset, AddRMSNormUnitOffset and QKNormUnitOffset of RMSNorm, AddRMSNorm and QKNorm (same
inputs, outputs and attributes).

A float32 bundle needs none of them: there 1 + weight is folded into the weight at build time, exactly
as HF computes it (in float32). In bfloat16 or float16 the sum is not exact in the weight's dtype and HF
multiplies in float32 before its one rounding, so these compute y_f32 * (1 + w_f32), rounded once.
No GPU kernel yet: a GPU build of a model that needs them is refused.
"""
import torch


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm_unit_offset(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    s = x + residual
    return rms_norm_unit_offset(s, weight, eps), s


def qk_norm_unit_offset(qkv, q_weight, k_weight, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = rms_norm_unit_offset(q.reshape(t, num_heads, head_dim), q_weight, eps).reshape(t, -1)
    k = rms_norm_unit_offset(k.reshape(t, num_kv_heads, head_dim), k_weight, eps).reshape(t, -1)
    return torch.cat([q, k, v], dim=-1)
