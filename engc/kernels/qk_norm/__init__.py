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


def launch(qkv, q_weight, k_weight, eps: float, out, consts=None):
    """Launch rule of qk_norm_kernel: [(variant, grid, args)].

    qkv, out: contiguous [T, (H + 2 KV) * D]; out may be qkv (in place, v untouched) or a separate buffer
    (v is copied). args: qkv, q_weight, k_weight, out, eps (fp32), copy_v (i32),
    global_scratch=0, profile_scratch=0. consts is unused.
    """
    rows = qkv.numel() // qkv.shape[-1]
    assert qkv.is_contiguous() and out.is_contiguous()
    if rows == 0:
        return []
    copy_v = 0 if out.data_ptr() == qkv.data_ptr() else 1
    return [("default", (rows, 1, 1), [qkv, q_weight, k_weight, out, float(eps), copy_v, 0, 0])]
