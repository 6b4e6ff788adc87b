"""The nodes the gated-activation kernel serves: SiluMul and GeluTanhMul."""
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.silu_mul import gelu_tanh_mul, launch, silu_mul

NODES = {"SiluMul": ("default", silu_mul), "GeluTanhMul": ("gelu_tanh", gelu_tanh_mul)}
CPU_OPS = {(ENGC_DOMAIN, node): (lambda fn: lambda x: (fn(x),))(fn) for node, (_, fn) in NODES.items()}


def gpu_ops(ctx) -> dict:
    consts = ctx.consts("silu_mul")

    def act(variant):
        def run(x):
            out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
            ctx.run("silu_mul", launch(x, out, consts, variant))
            return (out,)
        return run

    return {(ENGC_DOMAIN, node): act(variant) for node, (variant, _) in NODES.items() if variant in consts}
