"""The nodes the qk_norm kernel serves: QKNorm, Gemma's QKNormUnitOffset (its 'unit_offset' variant) and
OLMoE's QKNormProjection (its 'projection' variant)."""
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.qk_norm import launch, qk_norm, qk_norm_projection, qk_norm_unit_offset

NODES = {"QKNorm": ("default", qk_norm), "QKNormUnitOffset": ("unit_offset", qk_norm_unit_offset),
         "QKNormProjection": ("projection", qk_norm_projection)}
CPU_OPS = {(ENGC_DOMAIN, node): (lambda fn: lambda qkv, qw, kw, **a: (fn(qkv, qw, kw, **a),))(fn)
           for node, (_, fn) in NODES.items()}


def gpu_ops(ctx) -> dict:
    consts = ctx.consts("qk_norm")

    def qk(variant):
        def run(qkv, qw, kw, eps, **heads):   # the head counts are the kernel's constants (specs.py)
            out = torch.empty_like(qkv)
            ctx.run("qk_norm", launch(qkv, qw, kw, eps, out, variant=variant))
            return (out,)
        return run

    return {(ENGC_DOMAIN, node): qk(variant) for node, (variant, _) in NODES.items() if variant in consts}
