"""Per-head RMSNorm of the q and k parts of the fused qkv projection (Qwen3), before rotary.

ONNX: ai.engc::QKNorm(qkv, q_weight, k_weight) -> qkv, attributes num_heads, num_kv_heads, head_dim, eps;
ai.engc::QKNormUnitOffset the same with Gemma's (1 + weight) norm (half-precision bundles): the kernel's
'unit_offset' variant.
"""
import torch

from engc.kernels.rms_norm import rms_norm, rms_norm_unit_offset


def qk_norm(qkv, q_weight, k_weight, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
            norm=rms_norm):
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = norm(q.reshape(t, num_heads, head_dim), q_weight, eps).reshape(t, -1)
    k = norm(k.reshape(t, num_kv_heads, head_dim), k_weight, eps).reshape(t, -1)
    return torch.cat([q, k, v], dim=-1)


def qk_norm_unit_offset(qkv, q_weight, k_weight, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    return qk_norm(qkv, q_weight, k_weight, num_heads, num_kv_heads, head_dim, eps, norm=rms_norm_unit_offset)


def launch(qkv, q_weight, k_weight, eps: float, out, consts=None, variant: str = "default"):
    """Launch rule of qk_norm_kernel: [(variant, grid, args)].

    qkv, out: contiguous [T, (H + 2 KV) * D]; out may be qkv (in place, v untouched) or a separate buffer
    (v is copied). variant: 'default' or 'unit_offset'. args: qkv, q_weight, k_weight, out, eps (fp32), copy_v (i32),
    global_scratch=0, profile_scratch=0. consts is unused.
    """
    rows = qkv.numel() // qkv.shape[-1]
    assert qkv.is_contiguous() and out.is_contiguous()
    if rows == 0:
        return []
    copy_v = 0 if out.data_ptr() == qkv.data_ptr() else 1
    return [(variant, (rows, 1, 1), [qkv, q_weight, k_weight, out, float(eps), copy_v, 0, 0])]
