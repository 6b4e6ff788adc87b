"""Fuses an int4 QLinear (a layer's o or down projection) -> AddRMSNorm that adds it to the residual stream
into one ai.engc::QLinearAddRMSNorm node.

On the GPU, where a decode batch's CUDA GEMV splits K, each split then stores its fp32 partial and exits,
and the norm sums the partials in split order itself (kernels/rms_norm: the same bits as the GEMV's own
reduce), instead of the GEMV's last split fencing, taking a ticket and re-reading the others' partials,
a sizeable share of a short launch (bench/results/HISTORY.md). Other row counts, unsplit launches and
bundles without the norm's partials build run the two ops. Only projections without bias or act-order are fused (their launches are the
plain ones); the node's inputs are QLinear's four, then AddRMSNorm's residual and weight; its outputs and
eps are the norm's.
"""
from __future__ import annotations

from engc.compiler.ir import Graph, Node


def fuse_qlinear_add_norm(g: Graph) -> Graph:
    for norm in [n for n in g.nodes if n.op == "AddRMSNorm" and n.domain != ""]:
        producer = g.producer(norm.inputs[0])
        if (producer is None or producer.op != "QLinear" or producer.domain != norm.domain
                or len(producer.inputs) != 4 or producer.attrs.get("has_bias") or producer.attrs.get("act_order")
                or len(g.consumers(norm.inputs[0])) != 1 or norm.inputs[0] in g.outputs):
            continue
        fused = Node("QLinearAddRMSNorm", list(producer.inputs) + norm.inputs[1:], list(norm.outputs),
                     {"group_size": producer.attrs["group_size"], "eps": norm.attrs["eps"]})
        g.nodes[g.nodes.index(norm)] = fused
        g.nodes.remove(producer)
    return g
