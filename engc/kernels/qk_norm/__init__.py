"""RMSNorm of the q and k parts of the fused qkv projection, before rotary.

ONNX: ai.engc::QKNorm(qkv, q_weight, k_weight) -> qkv, attributes num_heads, num_kv_heads, head_dim, eps: each
head normed on its own, with one head_dim-wide weight (Qwen3); ai.engc::QKNormUnitOffset the same with Gemma's
(1 + weight) norm (half-precision bundles): the kernel's 'unit_offset' variant.
ai.engc::QKNormProjection(qkv, q_weight, k_weight) -> qkv, attribute eps: q normed as one vector over all its
heads and k likewise, with weights as wide as q and k (OLMoE; passes/fuse_projection_qk_norm.py makes it from
the RMSNorms the frontend puts on the two projections): the kernel's 'projection' variant. The weights' widths
give the parts' widths; v, the rest of the row, passes through.
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


def qk_norm_projection(qkv, q_weight, k_weight, eps: float):
    q, k, v = qkv.split([q_weight.numel(), k_weight.numel(), qkv.shape[-1] - q_weight.numel() - k_weight.numel()],
                        dim=-1)
    return torch.cat([rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), v], dim=-1)


def launch(qkv, q_weight, k_weight, eps: float, out, consts=None, variant: str = "default"):
    """Launch rule of qk_norm_kernel: [(variant, grid, args)].

    qkv, out: contiguous [T, (H + 2 KV) * D]; out may be qkv (in place, v untouched) or a separate buffer
    (v is copied). variant: 'default', 'unit_offset' or 'projection'. args: qkv, q_weight, k_weight, out,
    eps (fp32), copy_v (i32), global_scratch=0, profile_scratch=0. consts is unused.
    """
    rows = qkv.numel() // qkv.shape[-1]
    assert qkv.is_contiguous() and out.is_contiguous()
    if rows == 0:
        return []
    copy_v = 0 if out.data_ptr() == qkv.data_ptr() else 1
    return [(variant, (rows, 1, 1), [qkv, q_weight, k_weight, out, float(eps), copy_v, 0, 0])]
