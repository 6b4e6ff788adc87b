"""Moves OLMoE's q and k norms (an RMSNorm on each projection, before the qkv Concat) behind the Concat as one
ai.engc::QKNormProjection node (kernels/qk_norm), so the three projections become one Concat of GEMMs that
fuse_parallel_gemms, which runs next, makes one GEMM.

A decode step then launches one qkv GEMM and one norm where it launched three GEMMs, two norms and the
Concat's copy. Under tensor parallelism shard_tp has already made each norm SquareMean -> AllReduce ->
RMSNormByMean (every rank holds part of the row), which this pass leaves alone.
"""
from __future__ import annotations

from engc.compiler.ir import Graph, Node


def fuse_projection_qk_norm(g: Graph) -> Graph:
    for concat in [n for n in g.nodes if n.op == "Concat" and n.domain == "" and len(n.inputs) == 3]:
        norms = [g.producer(v) for v in concat.inputs[:2]]
        if not _fusable(g, concat, norms):
            continue
        raw = concat.outputs[0] + ".unnormed"
        fused = Node("QKNormProjection", [raw, norms[0].inputs[1], norms[1].inputs[1]], list(concat.outputs),
                     {"eps": norms[0].attrs["eps"]}, norms[0].domain)
        concat.inputs[:2] = [n.inputs[0] for n in norms]
        concat.outputs = [raw]
        g.nodes.insert(g.nodes.index(concat) + 1, fused)
        for n in norms:
            g.nodes.remove(n)
    return g


def _fusable(g: Graph, concat: Node, norms: list[Node | None]) -> bool:
    """q and k are each a plain RMSNorm's output read by the Concat alone, along the last axis, one eps."""
    return (concat.attrs.get("axis") in (-1, 1)
            and all(n is not None and n.op == "RMSNorm" and n.domain != "" for n in norms)
            and norms[0].attrs["eps"] == norms[1].attrs["eps"]
            and all(g.consumers(n.outputs[0]) == [concat] and n.outputs[0] not in g.outputs for n in norms))
