"""The nodes unit_offset_norm serves: RMSNormUnitOffset, AddRMSNormUnitOffset, QKNormUnitOffset."""
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.unit_offset_norm import (add_rms_norm_unit_offset, launch, launch_qk, qk_norm_unit_offset,
                                           rms_norm_unit_offset)

CPU_OPS = {
    (ENGC_DOMAIN, "RMSNormUnitOffset"): lambda x, w, eps: (rms_norm_unit_offset(x, w, eps),),
    (ENGC_DOMAIN, "AddRMSNormUnitOffset"): lambda x, r, w, eps: add_rms_norm_unit_offset(x, r, w, eps),
    (ENGC_DOMAIN, "QKNormUnitOffset"): lambda qkv, qw, kw, **a: (qk_norm_unit_offset(qkv, qw, kw, **a),),
}


def gpu_ops(ctx) -> dict:
    if not ctx.has("unit_offset_norm"):
        return {}

    def norm(x, w, eps):
        out = torch.empty_like(x)
        ctx.run("unit_offset_norm", launch(x, w, eps, out))
        return (out,)

    def add_norm(x, r, w, eps):
        out, r_out = torch.empty_like(x), torch.empty_like(r)
        ctx.run("unit_offset_norm", launch(x, w, eps, out, residual=r, residual_out=r_out))
        return out, r_out

    def qk(qkv, qw, kw, num_heads, num_kv_heads, head_dim, eps):
        out = torch.empty_like(qkv)
        ctx.run("unit_offset_norm", launch_qk(qkv, qw, kw, eps, out))
        return (out,)

    ops = {(ENGC_DOMAIN, "RMSNormUnitOffset"): norm, (ENGC_DOMAIN, "AddRMSNormUnitOffset"): add_norm}
    if "qk_norm" in ctx.consts("unit_offset_norm"):
        ops[(ENGC_DOMAIN, "QKNormUnitOffset")] = qk
    return ops
