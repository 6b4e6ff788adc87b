"""Fuses Gemms (or int4 QLinears) that read the same input and are joined by a Concat into one (qkv, gate_up).

One wide GEMM reads the activation once and launches once; the fused weight is the concatenation of
the parts along the output dimension (rows of a Gemm's transposed weight; rows of the N-major engc
int4 layout's qweight, scales, zeros and offsets), so the Concat's output is unchanged and downstream ops never
notice. act-order QLinears fuse where their input permutations are equal, as GPTQ's are for projections of one
input (one Hessian orders them), and keep that one permutation; otherwise they are left alone.
"""
from __future__ import annotations

import torch

from engc.compiler.ir import Graph, Node

# op -> the output-dimension axis of each weight input (after the activation), by position
_OUT_AXIS = {"Gemm": (0, 0), "QLinear": (0, 0, 0, 0, 0)}   # QLinear: qweight, scales, zeros[, bias][, offsets]


def fuse_parallel_gemms(g: Graph) -> Graph:
    for concat in [n for n in g.nodes if n.op == "Concat" and n.domain == ""]:
        parts = [g.producer(v) for v in concat.inputs]
        if not _fusable(g, concat, parts):
            continue
        name = concat.outputs[0]
        first = parts[0]
        inputs = [first.inputs[0]]
        for pos, axis in enumerate(_OUT_AXIS[first.op][:len(first.inputs) - 1], start=1):
            suffix = first.inputs[pos].rsplit(".", 1)[1]
            if suffix == "perm":   # one input order for all the parts (_fusable checked they agree)
                for other in parts[1:]:
                    g.weights.pop(other.inputs[pos])
                inputs.append(first.inputs[pos])
                continue
            inputs.append(_fuse_weights(g, [p.inputs[pos] for p in parts], f"{name}.{suffix}", axis))
        fused = Node(first.op, inputs, [name], dict(first.attrs), first.domain)
        at = g.nodes.index(first)
        for n in (*parts, concat):
            g.nodes.remove(n)
        g.nodes.insert(at, fused)
    return g


def _fusable(g: Graph, concat: Node, parts: list[Node | None]) -> bool:
    if any(p is None for p in parts) or concat.attrs.get("axis") not in (-1, 1):
        return False
    op = parts[0].op
    if op == "Gemm":
        if any(p.op != "Gemm" or p.attrs.get("transB") != 1 for p in parts):
            return False
    elif op == "QLinear":
        if any(p.op != "QLinear" or p.attrs != parts[0].attrs for p in parts):
            return False
        if parts[0].attrs.get("act_order") and not _same_permutation(g, parts):
            return False
    else:
        return False
    if len({p.inputs[0] for p in parts}) != 1 or len({len(p.inputs) for p in parts}) != 1:
        return False
    # each part must feed only the Concat, and its weights nothing else (they are about to vanish)
    return all(g.consumers(p.outputs[0]) == [concat] and
               all(len(g.consumers(w)) == 1 for w in p.inputs[1:]) for p in parts)


def _same_permutation(g: Graph, parts: list[Node]) -> bool:
    """The act-order QLinears' input permutations (their .perm weights, loaded: a few KB) are one."""
    perms = [next(w for w in p.inputs[1:] if w.endswith(".perm")) for p in parts]
    first = g.weights[perms[0]]()
    return all(torch.equal(first, g.weights[w]()) for w in perms[1:])


def _fuse_weights(g: Graph, names: list[str], fused_name: str, axis: int) -> str:
    loaders = [g.weights.pop(n) for n in names]
    g.weights[fused_name] = lambda: torch.cat([load() for load in loaders], dim=axis).contiguous()
    return fused_name
