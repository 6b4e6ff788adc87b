"""The node the MoE kernels serve: MoE (router, top-k experts' SiLU GLUs, weighted combine)."""
from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.moe import moe
from engc.kernels.moe.launch import forward

CPU_OPS = {(ENGC_DOMAIN, "MoE"): lambda *xs, **a: (moe(*xs, **a),)}


def gpu_ops(ctx) -> dict:
    if not ctx.has("moe"):
        return {}

    def moe_gpu(*xs, **attrs):
        return (forward(lambda launches: ctx.run("moe", launches), *xs, consts=ctx.consts("moe"),
                        quant=lambda launches: ctx.run("fp8_quant", launches), **attrs),)

    return {(ENGC_DOMAIN, "MoE"): moe_gpu}
