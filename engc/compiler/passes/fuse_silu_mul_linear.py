"""Fuses SiluMul -> Gemm (the MLP's down projection) into one ai.engc::SiluMulLinear(gate_up, W) node.

On the GPU, decode batches then run one GEMV that applies silu(gate) * up while it reads its input
(kernels/gemv), instead of a SiluMul launch and a cuBLAS GEMM with the activation round-tripping
through memory between them; wider batches run the two ops. The output value keeps the Gemm's
name, so nothing downstream changes.
"""
from __future__ import annotations

from engc.compiler.ir import Graph, Node


def fuse_silu_mul_linear(g: Graph) -> Graph:
    for act in [n for n in g.nodes if n.op == "SiluMul" and n.domain != ""]:
        users = g.consumers(act.outputs[0])
        if len(users) != 1 or not _plain_linear(users[0], act.outputs[0]):
            continue
        gemm = users[0]
        fused = Node("SiluMulLinear", [act.inputs[0], gemm.inputs[1]], list(gemm.outputs))
        g.nodes[g.nodes.index(gemm)] = fused
        g.nodes.remove(act)
    return g


def _plain_linear(n: Node, x: str) -> bool:
    """y = x @ W^T: an ONNX Gemm on x with transB, no bias, no scaling."""
    return (n.op == "Gemm" and n.domain == "" and len(n.inputs) == 2 and n.inputs[0] == x
            and n.attrs.get("transB") == 1 and not n.attrs.get("transA")
            and n.attrs.get("alpha", 1.0) == 1.0 and n.attrs.get("beta", 1.0) == 1.0)
