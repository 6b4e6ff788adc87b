"""Fuses AddRMSNorm -> Gemm (a decoder block's residual add and norm, then the qkv or gate_up projection that
reads the normed value) into one ai.engc::AddRMSNormLinear(x, residual, norm_weight, W) node.

On the GPU, decode batches of the M classes the bundle has a kernel for (kernels/norm_linear) then run one
launch that normalizes the input tiles as it loads them; other batches run the norm kernel and the GEMM as
before. The node takes the AddRMSNorm's place (its inputs are defined by then; the Gemm's consumers come
later still) and keeps both output names: the Gemm's, and the new residual. Only where the normed value has
no other reader and the Gemm is a plain x @ W^T (no bias): --quant fp8 and int4 programs have FP8Linear or
QLinear there and are left alone.
"""
from __future__ import annotations

from engc.compiler.ir import Graph, Node
from engc.compiler.passes.fuse_silu_mul_linear import _plain_linear


def fuse_norm_linear(g: Graph) -> Graph:
    for norm in [n for n in g.nodes if n.op == "AddRMSNorm" and n.domain != ""]:
        users = g.consumers(norm.outputs[0])
        if len(users) != 1 or not _plain_linear(users[0], norm.outputs[0]) or norm.outputs[0] in g.outputs:
            continue
        gemm = users[0]
        fused = Node("AddRMSNormLinear", [*norm.inputs, gemm.inputs[1]], [gemm.outputs[0], norm.outputs[1]],
                     dict(norm.attrs))
        g.nodes[g.nodes.index(norm)] = fused
        g.nodes.remove(gemm)
    return g
