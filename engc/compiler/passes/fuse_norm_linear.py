"""Fuses AddRMSNorm -> Gemm (the qkv and gate_up projections) into one ai.engc::AddRMSNormLinear node.

AddRMSNormLinear(x, residual, norm_weight, W) -> (y, x + residual), attribute eps. On the GPU a decode
batch of one row then runs one GEMV that adds the residual, applies the norm and multiplies
(kernels/gemv, NORM), instead of an add_rms_norm launch whose output round-trips through memory before
the GEMV; other batches run the two as before. Only an AddRMSNorm whose normalized output feeds nothing
but one plain Gemm is fused: the first block's RMSNorm (no residual) and the final norm (its rows are
gathered for sampling first) stay as they are. Outputs keep their names, so nothing downstream changes.
"""
from __future__ import annotations

from engc.compiler.ir import Graph, Node
from engc.compiler.passes.fuse_silu_mul_linear import _plain_linear


def fuse_norm_linear(g: Graph) -> Graph:
    for norm in [n for n in g.nodes if n.op == "AddRMSNorm" and n.domain != ""]:
        users = g.consumers(norm.outputs[0])
        if len(users) != 1 or not _plain_linear(users[0], norm.outputs[0]):
            continue
        gemm = users[0]
        fused = Node("AddRMSNormLinear", [*norm.inputs, gemm.inputs[1]], [gemm.outputs[0], norm.outputs[1]],
                     dict(norm.attrs))
        # at the Gemm's place: the residual output is first used after it (by the next block's norm)
        g.nodes[g.nodes.index(gemm)] = fused
        g.nodes.remove(norm)
    return g
