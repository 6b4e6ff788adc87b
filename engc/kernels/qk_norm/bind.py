"""The node the qk_norm kernel serves: QKNorm."""
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.qk_norm import launch, qk_norm

CPU_OPS = {(ENGC_DOMAIN, "QKNorm"): lambda qkv, qw, kw, **a: (qk_norm(qkv, qw, kw, **a),)}


def gpu_ops(ctx) -> dict:
    if not ctx.has("qk_norm"):
        return {}
    def qk(qkv, qw, kw, num_heads, num_kv_heads, head_dim, eps):
        out = torch.empty_like(qkv)
        ctx.run("qk_norm", launch(qkv, qw, kw, eps, out))
        return (out,)

    return {(ENGC_DOMAIN, "QKNorm"): qk}
