"""Shards the lowered program over tensor-parallel ranks (engc build --tp N), Megatron-style.

One program serves every rank; only the weights differ, and each lazy weight loads the shard of the rank
the writer asks for (Graph.rank). Column-parallel projections (q, k, v by heads; gate and up by
intermediate columns) need no communication; the row-parallel ones after them (o, down) each produce a
partial sum that an AllReduce completes, so a layer costs two all-reduces. A MoE layer splits every
expert's intermediate the same way, keeping the router whole: each rank runs the same routing and the same
kernels on narrower experts, so no rank idles when the router favours some experts. A shared expert is a
dense MLP split as the others, but its down's partial sum is the MoE node's input, added into the node's
own partial sum: one AllReduce completes the layer. Latent attention (DeepSeek) splits by heads too: q (or q_b
after the replicated q_a and its norm) by rows, each head's w_uk and w_uv, o by columns; the latent's
down-projection kv_a is replicated, since every head reads the whole latent, and so is each rank's latent
cache (one row a token, whatever the heads). int4 weights (QLinear, int4 experts) split like float ones: their
codes, scales and zeros by output rows; along the input (o, down) by 8-input words and whole groups, so a rank's
slice must be a multiple of the layout's 32-input chunk and of the group size, and act-order's input
permutation, which spans the ranks' slices, is refused. A norm over the whole q or k projection (OLMoE's)
normalizes rows that the ranks each hold a part of: each rank's sum of squares is all-reduced (one float a
token), and each rank scales its part by its slice of the norm's weight.

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
from engc.kernels.int4_linear.layout import CHUNK, PACK

# a layer's projection, the dense MLP's or (shared_expert.) an MoE layer's shared expert's
_PROJECTION = re.compile(r"layers\.\d+\.(shared_expert\.)?(q|q_a|q_b|kv_a|k|v|o|gate|up|down)\.(weight|bias|qweight)$")
# latent attention's down-projections: every rank reads the whole latent (and q's) they make
_REPLICATED = ("q_a", "kv_a")
_HEADS = ("RotaryKVWrite", "PagedAttention", "QKNorm", "QKNormUnitOffset", "QKLayerNorm")
# nodes that compute the same on a shard as on the whole (per row, per head, or replicated weights)
_AS_IS = {"Gather", "Concat", "Cast", "Add", "Mul", "RMSNorm", "AddRMSNorm", "RMSNormUnitOffset",
          "AddRMSNormUnitOffset", "SiluMul", "GeluTanhMul", "LogitSoftcap", "LatentRMSNorm", "LayerNorm",
          "AddLayerNorm"}


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
    # a rank's intermediate width: the dense MLP's, or (by the projection's prefix) a shared expert's
    mlp_width = {"": cfg.intermediate_size // tp, "shared_expert.": cfg.shared_expert_intermediate_size // tp}
    head_gather = next(n for n in g.nodes if n.op == "Gather" and n.inputs[1:] == ["logits_indices"])
    for node in list(g.nodes):
        if node.op == "RMSNorm" and (kind := _projection_kind(g, node.inputs[0])) in ("q", "k"):
            _shard_projection_norm(g, node, _heads_rows(cfg, tp, kind), tp)
        elif node.op in _AS_IS:
            continue
        elif node.op in _HEADS:
            node.attrs.update(num_heads=per_rank_heads, num_kv_heads=kv_head_of(cfg, tp, 0)[1])
            if node.op == "QKLayerNorm":   # a weight row per head: the rank's heads' rows
                _rows(g, node.inputs[1], _nth(per_rank_heads))
                _rows(g, node.inputs[2], lambda r: slice(*_span(kv_head_of(cfg, tp, r))))
        elif node.op in ("Gemm", "QLinear") and node.inputs[0] == head_gather.outputs[0]:
            _shard_head(g, node, cfg, tp)
        elif node.op in ("Gemm", "QLinear"):
            m = _PROJECTION.match(node.inputs[1])
            if m is None:
                raise UserError(f"--tp {tp}: the projection '{node.inputs[1]}' has no tensor-parallel layout")
            shared_expert, kind = m.group(1) or "", m.group(2)
            if kind in _REPLICATED:
                continue
            if kind in ("q", "q_b", "k", "v"):
                _out_rows(g, node, _heads_rows(cfg, tp, kind))
            elif kind in ("gate", "up"):
                _out_rows(g, node, _nth(mlp_width[shared_expert]))
            else:   # o, down: split by input columns, summed by an AllReduce
                width = per_rank_heads * (cfg.v_head_dim or d) if kind == "o" else mlp_width[shared_expert]
                _in_cols(g, node, width, tp)
                if not shared_expert:   # a shared expert's down feeds the MoE node, whose AllReduce sums both
                    _all_reduce(g, node)
        elif node.op == "MLAAttention":
            node.attrs["num_heads"] = per_rank_heads
            for w in node.inputs[10:12]:   # w_uk [H, nope, R], w_uv [H, v, R]: this rank's heads
                _rows(g, w, _nth(per_rank_heads))
        elif node.op == "MoE":
            _shard_moe(g, node, cfg.moe_intermediate_size // tp, tp)
            _all_reduce(g, node)
        else:
            raise UserError(f"--tp {tp}: {node.op} nodes do not shard yet")
    return g


def _nth(n: int):
    """rank -> the rank's slice of n-wide parts: [r * n, (r + 1) * n)."""
    return lambda r: slice(r * n, (r + 1) * n)


def _span(first_count: tuple[int, int]) -> tuple[int, int]:
    first, count = first_count
    return first, first + count


def _heads_rows(cfg: ModelConfig, tp: int, kind: str):
    """rank -> its rows of a q (q_b) or k / v projection: its heads' head_dim-wide rows (a KV head that ranks
    share, on each of them)."""
    d = cfg.head_dim
    if kind in ("q", "q_b"):
        return _nth(cfg.num_heads // tp * d)
    return lambda r: slice(*(h * d for h in _span(kv_head_of(cfg, tp, r))))


def _projection_kind(g: Graph, value: str) -> str | None:
    """'q', 'k', ... when value is a projection's output (float or int4), else None."""
    p = g.producer(value)
    m = p is not None and p.op in ("Gemm", "QLinear") and _PROJECTION.match(p.inputs[1])
    return m.group(2) if m else None


def _shard_projection_norm(g: Graph, node: Node, rows, tp: int) -> None:
    """RMSNorm(x, weight) over a projection the ranks hold parts of, as SquareMean -> AllReduce -> RMSNormByMean
    on the rank's part (kernels/rms_norm). Every rank's part is equally wide (heads by rank, or one shared KV
    head each), so the summed per-part means are the whole row's mean square."""
    x, weight = node.inputs
    _rows(g, weight, rows)
    mean_square = node.outputs[0] + ".mean_square"
    at = g.nodes.index(node)
    g.nodes[at:at + 1] = [Node("SquareMean", [x], [mean_square + ".partial"], {"parts": tp}),
                          Node("AllReduce", [mean_square + ".partial"], [mean_square]),
                          Node("RMSNormByMean", [x, mean_square, weight], node.outputs, {"eps": node.attrs["eps"]})]


def _per_rank(g: Graph, name: str, part) -> None:
    """Replaces weight `name` by the shard part(tensor, rank) of the rank the writer asks for."""
    load = g.weights[name]
    g.weights[name] = lambda: part(load(), g.rank).contiguous()


def _rows(g: Graph, name: str, rows) -> None:
    _per_rank(g, name, lambda t, r: t[rows(r)])


def _cols(g: Graph, name: str, cols) -> None:
    _per_rank(g, name, lambda t, r: t[:, cols(r)])


def _out_rows(g: Graph, node: Node, rows) -> None:
    """A column-parallel projection: the rank's output rows of each weight (an int4 one's codes, scales, zeros
    and offsets are all [N, ...]); act-order's input permutation is the whole input's, on every rank."""
    for w in node.inputs[1:]:
        if not w.endswith(".perm"):
            _rows(g, w, rows)


def _in_cols(g: Graph, node: Node, width: int, tp: int) -> None:
    """A row-parallel projection: the rank's `width` input columns, of int4 codes (8 a word) and of the groups
    they span, where the engc int4 layout's 32-input chunks and the groups fit a rank's slice."""
    group = node.attrs.get("group_size", 0)
    per_channel = group >= width * tp   # one group spans the whole input: every rank keeps its scales
    if node.op == "QLinear":
        if node.attrs.get("act_order"):
            raise UserError(f"--tp {tp}: '{node.inputs[1]}' is act-order int4 (desc_act), whose input order "
                            "spans the ranks' slices; quantize without act-order or build with --tp 1")
        if width % CHUNK or (not per_channel and width % group):
            raise UserError(f"--tp {tp}: '{node.inputs[1]}' would give a rank {width} inputs, not a multiple of "
                            f"{CHUNK} and of its int4 group size {group}")
    for w in node.inputs[1:]:
        key = w.rsplit(".", 1)[1]
        if key in ("weight", "qweight"):
            _cols(g, w, _nth(width // PACK if key == "qweight" else width))
        elif key in ("scales", "zeros", "offsets") and not per_channel:
            _cols(g, w, _nth(width // group))
        elif key not in ("scales", "zeros", "offsets"):
            raise UserError(f"--tp {tp}: '{w}' of a row-parallel projection does not shard")


def _all_reduce(g: Graph, node: Node) -> None:
    """node's output becomes a partial sum; an AllReduce right after it restores the value its users read."""
    out = node.outputs[0]
    node.outputs[0] = out + ".partial"
    g.nodes.insert(g.nodes.index(node) + 1, Node("AllReduce", [out + ".partial"], [out]))


def _shard_head(g: Graph, node: Node, cfg: ModelConfig, tp: int) -> None:
    """The lm_head split by vocabulary rows (the last rank's padded with zeros: an int4 head's zero codes, scales
    and zero points give zero logits too), its logits gathered whole."""
    rows = vocab_rows(cfg, tp)

    def shard(load, rank: int) -> torch.Tensor:
        part = load()[rank * rows:(rank + 1) * rows]
        return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])]).contiguous()
    if node.op == "Gemm":   # a tied head gets its own (sharded) tensor
        g.weights["lm_head.weight"] = lambda load=g.weights[node.inputs[1]]: shard(load, g.rank)
        node.inputs[1] = "lm_head.weight"
    else:
        for w in node.inputs[1:]:
            if not w.endswith(".perm"):
                g.weights[w] = lambda load=g.weights[w]: shard(load, g.rank)
    out = node.outputs[0]
    node.outputs[0] = out + ".shard"
    g.nodes.insert(g.nodes.index(node) + 1, Node("AllGather", [out + ".shard"], [out], {"size": cfg.vocab_size}))


def _shard_moe(g: Graph, node: Node, inter: int, tp: int) -> None:
    """Every expert's gate and up rows and down columns of this rank's intermediate slice (int4 experts: their
    codes, scales and zeros likewise, down's by words and groups); the router and the shared expert's gate stay
    whole, and the shared expert's output (a dense MLP's, sharded as one) is the rank's partial sum."""
    _, _, gate_up, down, *_ = node.inputs
    group = node.attrs.get("group_size", 0)
    if group and (inter % CHUNK or inter % group):
        raise UserError(f"--tp {tp}: int4 experts would give a rank {inter} intermediate columns, not a multiple "
                        f"of {CHUNK} and of their group size {group}")
    # [E, 2I, ...]: gate rows then up rows, each sliced
    for w in [gate_up] + [n for n in node.inputs if n.startswith(gate_up + ".")]:
        _per_rank(g, w, lambda t, r: torch.cat([half[:, _nth(inter)(r)] for half in t.chunk(2, dim=1)], dim=1))
    _per_rank(g, down, lambda t, r: t[:, :, _nth(inter // PACK if group else inter)(r)])
    for w in [n for n in node.inputs if n.startswith(down + ".")]:   # int4 scales and zeros [E, H, I / group]
        _per_rank(g, w, lambda t, r: t[:, :, _nth(inter // group)(r)])
