"""Fuses Gemms that read the same input and are joined by a Concat into one Gemm (qkv, gate_up).

One wide GEMM reads the activation once and launches once; the fused weight is the row-wise
concatenation of the parts, so the Concat's output is unchanged and downstream ops never notice.
"""
from __future__ import annotations

import torch

from engc.compiler.ir import Graph, Node


def fuse_parallel_gemms(g: Graph) -> Graph:
    for concat in [n for n in g.nodes if n.op == "Concat" and n.domain == ""]:
        parts = [g.producer(v) for v in concat.inputs]
        if not _fusable(g, concat, parts):
            continue
        name = concat.outputs[0]
        inputs = [parts[0].inputs[0], _fuse_weights(g, [p.inputs[1] for p in parts], name + ".weight")]
        if len(parts[0].inputs) == 3:
            inputs.append(_fuse_weights(g, [p.inputs[2] for p in parts], name + ".bias"))
        fused = Node("Gemm", inputs, [name], {"transB": 1}, "")
        at = g.nodes.index(parts[0])
        for n in (*parts, concat):
            g.nodes.remove(n)
        g.nodes.insert(at, fused)
    return g


def _fusable(g: Graph, concat: Node, parts: list[Node | None]) -> bool:
    if any(p is None or p.op != "Gemm" or p.attrs.get("transB") != 1 for p in parts):
        return False
    if concat.attrs.get("axis") not in (-1, 1):
        return False
    if len({p.inputs[0] for p in parts}) != 1 or len({len(p.inputs) for p in parts}) != 1:
        return False
    # each part must feed only the Concat, and its weights nothing else (they are about to vanish)
    return all(g.consumers(p.outputs[0]) == [concat] and
               all(len(g.consumers(w)) == 1 for w in p.inputs[1:]) for p in parts)


def _fuse_weights(g: Graph, names: list[str], fused_name: str) -> str:
    loaders = [g.weights.pop(n) for n in names]
    g.weights[fused_name] = lambda: torch.cat([load() for load in loaders], dim=0).contiguous()
    return fused_name
