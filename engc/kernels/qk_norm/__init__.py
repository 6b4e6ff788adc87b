"""Per-head RMSNorm of the q and k parts of the fused qkv projection (Qwen3), before rotary.

ONNX: ai.engc::QKNorm(qkv, q_weight, k_weight) -> qkv, attributes num_heads, num_kv_heads, head_dim, eps.
"""
import torch

from engc.kernels.rms_norm import rms_norm


def qk_norm(qkv, q_weight, k_weight, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = rms_norm(q.reshape(t, num_heads, head_dim), q_weight, eps).reshape(t, -1)
    k = rms_norm(k.reshape(t, num_kv_heads, head_dim), k_weight, eps).reshape(t, -1)
    return torch.cat([q, k, v], dim=-1)
