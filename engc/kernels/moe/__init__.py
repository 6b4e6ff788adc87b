"""A mixture-of-experts MLP: route each token to its top-k experts, run their SiLU GLUs, sum them weighted.

ONNX: ai.engc::MoE(x, router, gate_up, down[, shared[, shared_gate]]
                   [, gate_up_scales, gate_up_zeros, down_scales, down_zeros | gate_up_scale, down_scale]
                   [, correction_bias]) -> y
  x [T, H]; router [E, H]; gate_up [E, 2I, H] (each expert's gate rows, then its up rows); down [E, H, I];
  the optional shared expert's output shared [T, H] (the program computes it as a dense MLP beside the node)
  and its gate (Qwen2-MoE) shared_gate [1, H].
  int4 experts (group_size > 0): gate_up and down are stacks of the engc int4 layout (kernels/int4_linear),
  qweight [E, 2I, H / 8] and [E, H, I / 8], their scales and zeros [E, N, K / group_size] at the end.
  fp8 experts (fp8_experts = 1, engc build --quant fp8): gate_up and down are float8_e4m3fn, and where int4's
  four inputs go, their float32 scales per output channel per expert, gate_up_scale [E, 2I] and down_scale
  [E, H]: W[e, n, k] = q[e, n, k] * scale[e, n], the row quantization of the dense pass (kernels/fp8_quant).
Attributes (the routing variant; one op serves every family):
  top_k              experts per token
  softmax_first      1: softmax over all E router logits, then top-k of the probabilities (Mixtral, Qwen-MoE,
                     OLMoE); 0: top-k of the logits, then softmax over those k (renormalized by construction;
                     Granite MoE)
  renormalize        1: the k weights are divided by their sum (Mixtral; norm_topk_prob)
  has_shared_expert  1: add sigmoid(x @ shared_gate.T) * shared
  shared_ungated     1: shared is added as it is, with no shared_gate input (DeepSeek's shared experts,
                     stacked as one GLU of n_shared_experts * moe_intermediate_size)
DeepSeek's routings (absent: as above):
  sigmoid_scores     1: scores are sigmoid(logits), not their softmax (DeepSeek-V3)
  correction_bias    1: the last input, a float32 [E] bias, is added to the scores to choose the experts; the
                     weights are the unbiased scores of the chosen ones (V3's noaux_tc)
  n_group, topk_group  experts in n_group equal groups; only the topk_group best groups are eligible, a group
                     scored by its best expert (V2's group_limited_greedy) or with group_top2 = 1 by the sum of
                     its best two (V3)
  routed_scaling_factor  the weights times this, after any renormalization
  group_size         int4 experts' quantization group (0: float experts)
  fp8_experts        1: float8 experts with per-channel scales (see above)
  float32_weights    1: each expert's output times its float32 weight, then rounded (Mixtral); 0: the weights
                     are cast to the model dtype first (Qwen-MoE, OLMoE). Alike in float32 bundles.
y excludes the residual: the decoder adds it in the next norm, as it does for a dense MLP.

fp8 experts are W8A8, as the dense fp8 projections (kernels/fp8_quant's fp8_linear is the reference of
each expert GEMM): x is quantized per token for gate_up and each pair's SiLU-GLU output per row for down, by
the fp8 program's own quantization kernel (kernels/fp8_quant), and the GEMMs take float8 x float8 products
summed in float32 times both scales. A decode step is bound by the bytes of the experts it reads, which
float8 halves; at batch sizes where every expert is read, the float8 tensor cores keep the grouped GEMMs at
the copy rate.
The router stays in the model dtype, as do the shared expert's gate and the shared expert, which is the
program's own dense MLP beside the node (passes/quantize_fp8 says why fp8 leaves it so; DeepSeek's MLA
projections and dense layers are Gemms the dense pass quantizes, W8A8); the node only adds its output, in the
combine.

Ties between router scores go as torch.topk breaks them, which is what HF transformers calls: the
reference calls it on the same float32 probabilities, so a CPU bundle picks the experts HF picks.

This module is the reference (the CPU path and the kernels' test oracle). The GPU path is launch.py's: the
kernels' launch rules and forward(), which bind.py's GPU op runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engc.kernels.fp8_quant import fp8_linear
from engc.kernels.int4_linear.layout import dequantize


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, softmax_first: int = 1,
          renormalize: int = 0, sigmoid_scores: int = 0, bias: torch.Tensor | None = None, n_group: int = 1,
          topk_group: int = 1, group_top2: int = 0, routed_scaling_factor: float = 1.0,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] -> (weights [T, k] float32, expert ids [T, k] int64), the routing HF's TopKRouters compute."""
    if sigmoid_scores or bias is not None or n_group > 1 or routed_scaling_factor != 1.0:
        return _deepseek_route(x, router, top_k, renormalize, sigmoid_scores, bias, n_group, topk_group,
                               group_top2, routed_scaling_factor)
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


def _deepseek_route(x, router, top_k, renormalize, sigmoid_scores, bias, n_group, topk_group, group_top2,
                    scaling):
    """DeepSeek's routers (HF's DeepseekV2TopkRouter / DeepseekV3TopkRouter): float32 logits, softmax or sigmoid
    scores, the experts of the best groups only (masked to 0 under softmax, -inf under a correction bias, as
    HF masks them), top-k chosen on the biased scores, weighted by the unbiased ones."""
    logits = F.linear(x.float(), router.float())
    scores = torch.sigmoid(logits) if sigmoid_scores else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        grouped = choice.view(x.shape[0], n_group, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if group_top2 else grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        keep = keep[:, :, None].expand_as(grouped).reshape(x.shape[0], -1)
        choice = choice.masked_fill(~keep, 0.0 if bias is None else float("-inf"))
    weights, ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)
    if bias is not None:
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


# the MoE node's attributes of DeepSeek's routings (the correction bias is an input)
DEEPSEEK_ROUTING = ("sigmoid_scores", "n_group", "topk_group", "group_top2", "routed_scaling_factor")


def routing_of(attrs: dict, bias: torch.Tensor | None) -> dict:
    """route()'s keyword arguments from the node's routing attributes."""
    keys = ("softmax_first", "renormalize", *DEEPSEEK_ROUTING)
    return {**{k: attrs[k] for k in keys if k in attrs}, "bias": bias}


def glu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SiLU GLU: gate_up [2I, H] (gate rows first), down [H, I]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def fp8_glu(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
            down_scale: torch.Tensor) -> torch.Tensor:
    """glu() of one fp8 expert: the same roundings (gate, up, silu, product, output), each GEMM W8A8 as the
    dense fp8 projections' (fp8_linear: the input quantized per row, float32 products)."""
    gate, up = fp8_linear(x, gate_up, gate_up_scale).chunk(2, dim=-1)
    return fp8_linear(F.silu(gate) * up, down, down_scale)


def expert_inputs(rest: tuple, has_shared_expert: int, shared_ungated: int, correction_bias: int) -> tuple:
    """The node's inputs after down, split: (shared expert's, the experts' quantization's, correction bias)."""
    n_shared = (1 if shared_ungated else 2) if has_shared_expert else 0
    shared, rest = rest[:n_shared], rest[n_shared:]
    bias, rest = (rest[-1], rest[:-1]) if correction_bias else (None, rest)
    return shared, rest, bias


def moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *rest: torch.Tensor,
        top_k: int, softmax_first: int = 1, renormalize: int = 0, has_shared_expert: int = 0,
        group_size: int = 0, float32_weights: int = 0, shared_ungated: int = 0, correction_bias: int = 0,
        fp8_experts: int = 0, **routing) -> torch.Tensor:
    shared, rest, bias = expert_inputs(rest, has_shared_expert, shared_ungated, correction_bias)
    weights, ids = route(x, router, top_k, **routing_of({"softmax_first": softmax_first, "renormalize": renormalize,
                                                        **routing}, bias))
    weights = weights if float32_weights else weights.to(x.dtype)
    # each (token, slot) pair's weighted expert output, then the sum over a token's slots, rounded once: what
    # transformers' grouped experts (its default) compute, so a bfloat16 bundle rounds as HF does
    pairs = torch.zeros(*ids.shape, x.shape[1], dtype=torch.promote_types(x.dtype, weights.dtype),
                        device=x.device)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        if fp8_experts:
            pairs[token, slot] = fp8_glu(x[token], gate_up[e], rest[0][e], down[e], rest[1][e]) * \
                weights[token, slot, None]
            continue
        if group_size:   # int4 experts: each used one dequantized as QLinear's reference does
            w_gate_up, w_down = (dequantize(gate_up[e], rest[0][e], rest[1][e], group_size).to(x.dtype),
                                 dequantize(down[e], rest[2][e], rest[3][e], group_size).to(x.dtype))
        else:
            w_gate_up, w_down = gate_up[e], down[e]
        pairs[token, slot] = glu(x[token], w_gate_up, w_down) * weights[token, slot, None]
    out = pairs.sum(dim=1).to(x.dtype)
    if has_shared_expert and shared_ungated:
        out = out + shared[0]
    elif has_shared_expert:
        out = out + torch.sigmoid(F.linear(x, shared[1])) * shared[0]
    return out
