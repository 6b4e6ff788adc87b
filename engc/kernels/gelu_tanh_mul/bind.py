"""The node gelu_tanh_mul serves: GeluTanhMul."""
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.gelu_tanh_mul import gelu_tanh_mul, launch

CPU_OPS = {(ENGC_DOMAIN, "GeluTanhMul"): lambda x: (gelu_tanh_mul(x),)}


def gpu_ops(ctx) -> dict:
    if not ctx.has("gelu_tanh_mul"):
        return {}

    def act(x):
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
        ctx.run("gelu_tanh_mul", launch(x, out, ctx.consts("gelu_tanh_mul")))
        return (out,)

    return {(ENGC_DOMAIN, "GeluTanhMul"): act}
