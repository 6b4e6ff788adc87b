"""A mixture-of-experts MLP: route each token to its top-k experts, run their SiLU GLUs, sum them weighted.

ONNX: ai.engc::MoE(x, router, gate_up, down[, shared_gate_up, shared_down, shared_gate]) -> y
  x [T, H]; router [E, H]; gate_up [E, 2I, H] (each expert's gate rows, then its up rows); down [E, H, I];
  the optional shared expert (Qwen2-MoE): shared_gate_up [2S, H], shared_down [H, S], shared_gate [1, H].
Attributes (the routing variant; one op serves every family):
  top_k              experts per token
  softmax_first      1: softmax over all E router logits, then top-k of the probabilities (Mixtral, Qwen-MoE,
                     OLMoE); 0: top-k of the logits, then softmax over those k (renormalized by construction)
  renormalize        1: the k weights are divided by their sum (Mixtral; norm_topk_prob)
  has_shared_expert  1: add sigmoid(x @ shared_gate.T) * the shared expert's SiLU GLU of x
y excludes the residual: the decoder adds it in the next norm, as it does for a dense MLP.

Ties between router scores go as torch.topk breaks them, which is what HF transformers calls: the
reference calls it on the same float32 probabilities, so a CPU bundle picks the experts HF picks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


def moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
        shared_gate_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None, *, top_k: int, softmax_first: int = 1,
        renormalize: int = 0, has_shared_expert: int = 0, **_) -> torch.Tensor:
    weights, ids = route(x, router, top_k, softmax_first, renormalize)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    # expert by expert in ascending id, each over the tokens routed to it, summed with index_add_: the order
    # HF's eager experts loop adds them in, so float32 sums round alike
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        y = glu(x[token], gate_up[e], down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    if has_shared_expert:
        out = out + torch.sigmoid(F.linear(x, shared_gate)) * glu(x, shared_gate_up, shared_down)
    return out


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int):
    """The grouped GEMMs' schedule: each (token, slot) pair listed under its expert, each expert's list padded
    to a multiple of block_m, so every BLOCK_M rows of the sorted list belong to one expert.

    ids [T, k] -> (rows [P] int32: the pair's flat index t * k + slot, T * k for padding;
                   block_expert [P / block_m] int32: the expert of each block)
    """
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    rows = torch.full((int(padded.sum()),), flat.numel(), dtype=torch.int32, device=flat.device)
    rows[starts[flat[order]] + rank] = order.to(torch.int32)
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device, dtype=torch.int32),
                                           padded // block_m)
    return rows, block_expert
