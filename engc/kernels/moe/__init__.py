"""A mixture-of-experts MLP: route each token to its top-k experts, run their SiLU GLUs, sum them weighted.

ONNX: ai.engc::MoE(x, router, gate_up, down[, shared_gate_up, shared_down, shared_gate]
                   [, gate_up_scales, gate_up_zeros, down_scales, down_zeros]) -> y
  x [T, H]; router [E, H]; gate_up [E, 2I, H] (each expert's gate rows, then its up rows); down [E, H, I];
  the optional shared expert (Qwen2-MoE): shared_gate_up [2S, H], shared_down [H, S], shared_gate [1, H].
  int4 experts (group_size > 0): gate_up and down are stacks of the engc int4 layout (kernels/int4_linear),
  qweight [E, 2I, H / 8] and [E, H, I / 8], their scales and zeros [E, N, K / group_size] at the end.
Attributes (the routing variant; one op serves every family):
  top_k              experts per token
  softmax_first      1: softmax over all E router logits, then top-k of the probabilities (Mixtral, Qwen-MoE,
                     OLMoE); 0: top-k of the logits, then softmax over those k (renormalized by construction)
  renormalize        1: the k weights are divided by their sum (Mixtral; norm_topk_prob)
  has_shared_expert  1: add sigmoid(x @ shared_gate.T) * the shared expert's SiLU GLU of x
  group_size         int4 experts' quantization group (0: float experts)
  float32_weights    1: each expert's output times its float32 weight, then rounded (Mixtral); 0: the weights
                     are cast to the model dtype first (Qwen-MoE, OLMoE). Alike in float32 bundles.
y excludes the residual: the decoder adds it in the next norm, as it does for a dense MLP.

Ties between router scores go as torch.topk breaks them, which is what HF transformers calls: the
reference calls it on the same float32 probabilities, so a CPU bundle picks the experts HF picks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engc.kernels.int4_linear.layout import dequantize


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, softmax_first: int = 1,
          renormalize: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] -> (weights [T, k] float32, expert ids [T, k] int64), the routing HF's TopKRouters compute."""
    logits = F.linear(x, router)
    if softmax_first:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    return weights, ids


def glu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SiLU GLU: gate_up [2I, H] (gate rows first), down [H, I]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *rest: torch.Tensor,
        top_k: int, softmax_first: int = 1, renormalize: int = 0, has_shared_expert: int = 0,
        group_size: int = 0, float32_weights: int = 0, **_) -> torch.Tensor:
    shared, rest = (rest[:3], rest[3:]) if has_shared_expert else ((), rest)
    weights, ids = route(x, router, top_k, softmax_first, renormalize)
    weights = weights if float32_weights else weights.to(x.dtype)
    # each (token, slot) pair's weighted expert output, then the sum over a token's slots, rounded once: what
    # transformers' grouped experts (its default) compute, so a bfloat16 bundle rounds as HF does
    pairs = torch.zeros(*ids.shape, x.shape[1], dtype=torch.promote_types(x.dtype, weights.dtype),
                        device=x.device)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        if group_size:   # int4 experts: each used one dequantized as QLinear's reference does
            w_gate_up, w_down = (dequantize(gate_up[e], rest[0][e], rest[1][e], group_size).to(x.dtype),
                                 dequantize(down[e], rest[2][e], rest[3][e], group_size).to(x.dtype))
        else:
            w_gate_up, w_down = gate_up[e], down[e]
        pairs[token, slot] = glu(x[token], w_gate_up, w_down) * weights[token, slot, None]
    out = pairs.sum(dim=1).to(x.dtype)
    if has_shared_expert:
        shared_gate_up, shared_down, shared_gate = shared
        out = out + torch.sigmoid(F.linear(x, shared_gate)) * glu(x, shared_gate_up, shared_down)
    return out


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int):
    """The grouped GEMMs' schedule: each (token, slot) pair listed under its expert, each expert's list padded
    to a multiple of block_m, so every BLOCK_M rows of the sorted list belong to one expert. The sizes follow
    from the shapes alone (room for every expert's padding), so nothing waits on the GPU and a CUDA graph
    can hold it.

    ids [T, k] -> (rows [P] int32: the pair's flat index t * k + slot, T * k for padding;
                   block_expert [P / block_m] int32: the expert of each block, -1 past the last one)
    """
    flat = ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    blocks = (n + num_experts * (block_m - 1) + block_m - 1) // block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]
    rows = torch.full((blocks * block_m,), n, dtype=torch.int32, device=dev)
    rows[(ends - padded)[expert] + rank] = order.to(torch.int32)
    block_expert = torch.searchsorted(ends, torch.arange(blocks, device=dev) * block_m, right=True)
    return rows, torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)


# ---- the GPU path: launch rules, and the order the binding runs them in ---------------------------------

def launch_route(x, router, shared_gate, weights, ids, shared_weight, softmax_first: int, renormalize: int,
                 float32_weights: int = 0):
    """moe_route_kernel, grid (T,). args: x, router, shared_gate, weights [T, k] f32, ids [T, k] i32,
    shared_weight [T] f32, softmax_first, renormalize, float32_weights, scratch, scratch. shared_gate and
    shared_weight are any tensor where the model has no shared expert (the kernel, compiled without it,
    reads neither)."""
    if x.shape[0] == 0:
        return []
    return [("route", (x.shape[0], 1, 1), [x, router, shared_gate, weights, ids, shared_weight,
                                          int(softmax_first), int(renormalize), int(float32_weights), 0, 0])]


def launch_experts(x, gate_up, down, rows, block_expert, weights, act, pairs, consts, decode: bool):
    """moe_gate_up_kernel then moe_down_kernel over the schedule rows/block_expert (sort_by_expert, or for the
    decode variants one pair a program: rows = 0..T*k-1, block_expert = ids). act [len(rows), I], pairs
    [T*k, H] (each pair's weighted expert output). consts: '<variant>' -> {'BLOCK_M', 'BLOCK_N'}."""
    num_pairs = weights.numel()
    if num_pairs == 0:
        return []
    gate_up_variant, down_variant = ("gate_up_decode", "down_decode") if decode else ("gate_up", "down")
    blocks = block_expert.numel()
    inter, hidden = down.shape[2], down.shape[1]
    cdiv = lambda a, b: (a + b - 1) // b  # noqa: E731
    return [(gate_up_variant, (blocks, cdiv(inter, consts[gate_up_variant]["BLOCK_N"]), 1),
             [x, gate_up, rows, block_expert, act, num_pairs, 0, 0]),
            (down_variant, (blocks, cdiv(hidden, consts[down_variant]["BLOCK_N"]), 1),
             [act, down, rows, block_expert, weights, pairs, num_pairs, 0, 0])]


def launch_combine(pairs, shared, shared_weight, out, consts):
    """moe_combine_kernel, grid (T, cdiv(H, BLOCK)). args: pairs, shared [T, H] (any tensor without a shared
    expert), shared_weight, out, scratch, scratch."""
    if out.shape[0] == 0:
        return []
    block = consts["combine"]["BLOCK"]
    return [("combine", (out.shape[0], (out.shape[1] + block - 1) // block, 1),
             [pairs, shared, shared_weight, out, 0, 0])]


def forward(run, x, router, gate_up, down, shared_gate_up=None, shared_down=None, shared_gate=None, *,
            top_k: int, consts: dict, softmax_first: int = 1, renormalize: int = 0, has_shared_expert: int = 0,
            group_size: int = 0, float32_weights: int = 0, **_) -> torch.Tensor:
    """The MoE node on the GPU: run(launches) runs each launch rule's output (the runtime's BundleKernels, or
    the interpreter in the tests). Up to consts['gate_up_decode']['max_pairs'] (token, expert) pairs take the decode
    variants, which skip the sort; more are sorted by expert and padded to BLOCK_M for the grouped GEMMs.
    The shared expert is a dense SiLU GLU on every token: its GEMMs are torch's (cuBLAS)."""
    assert not group_size, "int4 experts have no GPU kernels: engc build refuses such a GPU bundle"
    t, e = x.shape[0], gate_up.shape[0]
    out = torch.empty_like(x)
    if t == 0:
        return out
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    shared_weight = torch.empty(t if has_shared_expert else 1, dtype=torch.float32, device=x.device)
    run(launch_route(x, router, shared_gate if has_shared_expert else router, weights, ids, shared_weight,
                     softmax_first, renormalize, float32_weights))
    decode = t * top_k <= consts["gate_up_decode"]["max_pairs"]
    if decode:
        rows = torch.arange(t * top_k, dtype=torch.int32, device=x.device)
        block_expert = ids.reshape(-1)
    else:
        rows, block_expert = sort_by_expert(ids, e, consts["gate_up"]["BLOCK_M"])
    act = torch.empty(rows.numel(), down.shape[2], dtype=x.dtype, device=x.device)
    pairs = torch.empty(t * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    run(launch_experts(x, gate_up, down, rows, block_expert, weights, act, pairs, consts, decode))
    shared = glu(x, shared_gate_up, shared_down) if has_shared_expert else pairs
    run(launch_combine(pairs, shared, shared_weight, out, consts))
    return out
