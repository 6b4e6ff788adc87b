"""Shards the lowered program over tensor-parallel ranks (engc build --tp N), Megatron-style.

One program serves every rank; only the weights differ, and each lazy weight loads the shard of the rank
the writer asks for (Graph.rank). Column-parallel projections (q, k, v by heads; gate and up by
intermediate columns) need no communication; the row-parallel ones after them (o, down) each produce a
partial sum that an AllReduce completes, so a layer costs two all-reduces. A MoE layer splits every
expert's (and the shared expert's) intermediate the same way, keeping the router whole: each rank runs
the same routing and the same kernels on narrower experts, so no rank idles when the router favours some
experts, and one AllReduce completes the layer.

The embedding stays whole on every rank: a lookup reads only the step's rows, and a vocabulary-parallel
one would cost one more all-reduce a step for memory the lm_head saves anyway. The lm_head is split by
vocabulary rows (the largest GEMM of a decode step, divided by N), and an AllGather joins the logits
before the head's soft-cap and cast, so sampling sees the whole vocabulary.

It runs first, on the unfused lowered graph, so every later pass (fusion, fp8, the decode form) works on
the shard shapes; the attention nodes' head counts become the rank's.
"""
from __future__ import annotations

import re

import torch

from engc.bundle.model_config import ModelConfig
from engc.bundle.tp import kv_head_of, shard_problem, vocab_rows
from engc.compiler.ir import Graph, Node
from engc.errors import UserError

_PROJECTION = re.compile(r"layers\.\d+\.(q|k|v|o|gate|up|down)\.(weight|bias)$")
_HEADS = ("RotaryKVWrite", "PagedAttention", "QKNorm", "QKNormUnitOffset")
# nodes that compute the same on a shard as on the whole (per row, per head, or replicated weights)
_AS_IS = {"Gather", "Concat", "Cast", "Mul", "RMSNorm", "AddRMSNorm", "RMSNormUnitOffset",
          "AddRMSNormUnitOffset", "SiluMul", "GeluTanhMul", "LogitSoftcap"}


def tp_pass(cfg: ModelConfig, tp: int):
    """The shard_tp pass for this model over tp ranks; refuses (UserError) what does not shard."""
    problem = shard_problem(cfg, tp)
    if problem:
        raise UserError(f"--tp {tp}: {problem}")

    def shard_tp(g: Graph) -> Graph:
        return _shard(g, cfg, tp)
    return shard_tp


def _shard(g: Graph, cfg: ModelConfig, tp: int) -> Graph:
    g.tp = tp
    d, per_rank_heads = cfg.head_dim, cfg.num_heads // tp
    inter = {"gate": cfg.intermediate_size // tp, "up": cfg.intermediate_size // tp}
    head_gather = next(n for n in g.nodes if n.op == "Gather" and n.inputs[1:] == ["logits_indices"])
    for node in list(g.nodes):
        if node.op in _AS_IS:
            if node.op == "RMSNorm" and _is_projection(g, node.inputs[0], ("q", "k")):
                raise UserError(f"--tp {tp}: {cfg.family}'s q/k norm over the whole projection does not shard")
            continue
        if node.op in _HEADS:
            node.attrs.update(num_heads=per_rank_heads, num_kv_heads=kv_head_of(cfg, tp, 0)[1])
        elif node.op == "Gemm" and node.inputs[0] == head_gather.outputs[0]:
            _shard_head(g, node, cfg, tp)
        elif node.op == "Gemm":
            m = _PROJECTION.match(node.inputs[1])
            if m is None:
                raise UserError(f"--tp {tp}: the projection '{node.inputs[1]}' has no tensor-parallel layout")
            kind = m.group(1)
            for w in node.inputs[1:]:
                if kind == "q":
                    _rows(g, w, lambda r, n=per_rank_heads * d: slice(r * n, (r + 1) * n))
                elif kind in ("k", "v"):
                    _rows(g, w, lambda r: slice(*(h * d for h in _span(kv_head_of(cfg, tp, r)))))
                elif kind in inter:
                    _rows(g, w, lambda r, n=inter[kind]: slice(r * n, (r + 1) * n))
                else:   # o, down: split by input columns, summed by an AllReduce
                    width = per_rank_heads * d if kind == "o" else inter["gate"]
                    _cols(g, w, lambda r, n=width: slice(r * n, (r + 1) * n))
            if kind in ("o", "down"):
                _all_reduce(g, node)
        elif node.op == "MoE":
            if node.attrs.get("group_size"):
                raise UserError(f"--tp {tp}: int4 experts do not shard yet; build the float checkpoint")
            _shard_moe(g, node, cfg.moe_intermediate_size // tp, cfg.shared_expert_intermediate_size // tp)
            _all_reduce(g, node)
        elif node.op == "QLinear":
            raise UserError(f"--tp {tp}: int4 projections do not shard yet; build the float checkpoint")
        else:
            raise UserError(f"--tp {tp}: {node.op} nodes do not shard yet")
    return g


def _span(first_count: tuple[int, int]) -> tuple[int, int]:
    first, count = first_count
    return first, first + count


def _is_projection(g: Graph, value: str, kinds: tuple[str, ...]) -> bool:
    p = g.producer(value)
    m = p is not None and p.op == "Gemm" and _PROJECTION.match(p.inputs[1])
    return bool(m) and m.group(1) in kinds


def _per_rank(g: Graph, name: str, part) -> None:
    """Replaces weight `name` by the shard part(tensor, rank) of the rank the writer asks for."""
    load = g.weights[name]
    g.weights[name] = lambda: part(load(), g.rank).contiguous()


def _rows(g: Graph, name: str, rows) -> None:
    _per_rank(g, name, lambda t, r: t[rows(r)])


def _cols(g: Graph, name: str, cols) -> None:
    _per_rank(g, name, lambda t, r: t[:, cols(r)])


def _all_reduce(g: Graph, node: Node) -> None:
    """node's output becomes a partial sum; an AllReduce right after it restores the value its users read."""
    out = node.outputs[0]
    node.outputs[0] = out + ".partial"
    g.nodes.insert(g.nodes.index(node) + 1, Node("AllReduce", [out + ".partial"], [out]))


def _shard_head(g: Graph, node: Node, cfg: ModelConfig, tp: int) -> None:
    """The lm_head split by vocabulary rows (the last rank's padded with zeros), its logits gathered whole."""
    rows = vocab_rows(cfg, tp)
    source = node.inputs[1]
    load = g.weights[source]

    def shard(rank: int) -> torch.Tensor:
        part = load()[rank * rows:(rank + 1) * rows]
        return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])]).contiguous()
    g.weights["lm_head.weight"] = lambda: shard(g.rank)   # a tied head gets its own (sharded) tensor
    node.inputs[1] = "lm_head.weight"
    out = node.outputs[0]
    node.outputs[0] = out + ".shard"
    g.nodes.insert(g.nodes.index(node) + 1, Node("AllGather", [out + ".shard"], [out], {"size": cfg.vocab_size}))


def _shard_moe(g: Graph, node: Node, inter: int, shared: int) -> None:
    """Every expert's gate and up rows and down columns of this rank's intermediate slice; the router and the
    shared expert's gate stay whole."""
    def cut(i: int):
        return lambda r: slice(r * i, (r + 1) * i)
    _, _, gate_up, down, *rest = node.inputs
    # [E, 2I, H]: gate rows then up rows, each sliced
    _per_rank(g, gate_up, lambda t, r: torch.cat([half[:, cut(inter)(r)] for half in t.chunk(2, dim=1)], dim=1))
    _per_rank(g, down, lambda t, r: t[:, :, cut(inter)(r)])
    if node.attrs.get("has_shared_expert"):
        shared_gate_up, shared_down = rest[:2]
        _per_rank(g, shared_gate_up, lambda t, r: torch.cat([half[cut(shared)(r)] for half in t.chunk(2)]))
        _cols(g, shared_down, cut(shared))
