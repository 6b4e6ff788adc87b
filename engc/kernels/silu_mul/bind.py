"""The node the silu_mul kernel serves: SiluMul."""
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.silu_mul import launch, silu_mul

CPU_OPS = {(ENGC_DOMAIN, "SiluMul"): lambda x: (silu_mul(x),)}


def gpu_ops(ctx) -> dict:
    if not ctx.has("silu_mul"):
        return {}
    def act(x):
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
        ctx.run("silu_mul", launch(x, out, ctx.consts("silu_mul")))
        return (out,)

    return {(ENGC_DOMAIN, "SiluMul"): act}
