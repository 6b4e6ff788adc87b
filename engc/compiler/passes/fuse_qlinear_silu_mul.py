"""Fuses an int4 QLinear (the MLP's fused gate_up) -> SiluMul into one ai.engc::QLinearSiluMul node.

On the GPU, decode batches then run one CUDA GEMV that writes silu(gate) * up itself (the SiLU-out build of
templates/int4_gemv.cu.j2, kernels/int4_linear.run_quantized_silu) instead of the GEMV, a silu_mul launch and
the gate_up round trip through memory between them; other row counts and bundles without that build run the
two ops. The node keeps QLinear's inputs and attributes, and SiluMul's output name.
"""
from __future__ import annotations

from engc.compiler.ir import Graph, Node


def fuse_qlinear_silu_mul(g: Graph) -> Graph:
    for act in [n for n in g.nodes if n.op == "SiluMul" and n.domain != ""]:
        producer = g.producer(act.inputs[0])
        if (producer is None or producer.op != "QLinear" or len(g.consumers(act.inputs[0])) != 1
                or act.inputs[0] in g.outputs):
            continue
        fused = Node("QLinearSiluMul", list(producer.inputs), list(act.outputs), dict(producer.attrs))
        g.nodes[g.nodes.index(act)] = fused
        g.nodes.remove(producer)
    return g
