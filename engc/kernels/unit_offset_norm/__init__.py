"""Gemma's RMSNorm, which scales by (1 + weight), for half-precision bundles: the named variants
RMSNormUnitOffset, AddRMSNormUnitOffset and QKNormUnitOffset of RMSNorm, AddRMSNorm and QKNorm (same
inputs, outputs and attributes).

A float32 bundle needs none of them: there 1 + weight is folded into the weight at build time, exactly
as HF computes it (in float32). In bfloat16 or float16 the sum is not exact in the weight's dtype and HF
multiplies in float32 before its one rounding, so these compute y_f32 * (1 + w_f32), rounded once.
The Triton kernels (triton.py, op "unit_offset_norm") compute the same, a row (a token's q and k heads) a
program, with RMSNorm's and QKNorm's launch rules and argument orders.
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


def launch(x, weight, eps: float, out, residual=None, residual_out=None, consts=None):
    """Launch rule of rms_norm_unit_offset_kernel: [(variant, grid, args)]; 'rms_norm' without a residual,
    'add_rms_norm' with one (x + residual written to residual_out, default the residual buffer, in place).
    args: x, residual, weight, out, residual_out, eps (fp32), global_scratch=0, profile_scratch=0
    (the 'rms_norm' variant ignores the residual slots; they carry x and out). consts is unused."""
    rows = x.numel() // x.shape[-1]
    if residual is None:
        variant, residual, residual_out = "rms_norm", x, out
    else:
        variant, residual_out = "add_rms_norm", residual if residual_out is None else residual_out
    for t in (x, residual, out, residual_out):
        assert t.is_contiguous() and t.shape[-1] == x.shape[-1]
    if rows == 0:
        return []
    return [(variant, (rows, 1, 1), [x, residual, weight, out, residual_out, float(eps), 0, 0])]


def launch_qk(qkv, q_weight, k_weight, eps: float, out, consts=None):
    """Launch rule of qk_norm_unit_offset_kernel: [('qk_norm', grid, args)], as kernels/qk_norm's launch:
    out may be qkv (in place, v untouched) or a separate buffer (v copied).
    args: qkv, q_weight, k_weight, out, eps (fp32), copy_v (i32), global_scratch=0, profile_scratch=0."""
    rows = qkv.numel() // qkv.shape[-1]
    assert qkv.is_contiguous() and out.is_contiguous()
    if rows == 0:
        return []
    copy_v = 0 if out.data_ptr() == qkv.data_ptr() else 1
    return [("qk_norm", (rows, 1, 1), [qkv, q_weight, k_weight, out, float(eps), copy_v, 0, 0])]
