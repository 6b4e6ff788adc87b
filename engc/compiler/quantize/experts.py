"""engc quantize of a mixture-of-experts layer: the attention projections and each expert's three, one by one
in the layer's stream; the router (and DeepSeek-V3's correction bias), the norms and the shared experts stay
float.

RTN reads the weights alone. GPTQ quantizes each expert from the calibration tokens the router sends it
(gptq_experts), and the next layer's input comes through the quantized MoE (MoeMlp, the MoE op's math on
the layer's weights). AWQ's scale search over a layer's MLP input has no single input to search for
experts that each see other tokens: it is refused for MoE models.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engc.compiler.frontend.block_facts import with_defaults
from engc.compiler.frontend.families import family_of
from engc.compiler.frontend.moe import _routing_attrs, is_moe_layer
from engc.compiler.quantize.layer import LINEARS
from engc.kernels.moe import glu, route, routing_of


def moe_linears(hf: dict, layer: int, weights: dict, dtypes: dict, attention: tuple[str, ...] = LINEARS[:4]) \
        -> tuple[str, ...] | None:
    """The projections engc quantize packs in an MoE layer (None for a dense one): the attention's, then each
    expert's as HF per-expert names relative to the layer, as the family's per-expert checkpoints name them.
    Fused experts (transformers' experts.gate_up_proj / down_proj) in `weights` are split into those names in
    place, so the written checkpoint has one int4 projection per expert, as AutoAWQ and GPTQ tools write MoE
    models (dtypes, the source dtype of each name, learns the new names)."""
    family = family_of(hf)
    if not is_moe_layer(hf, family, layer):
        return None
    ex = family.experts
    gate, up, down = ex.gate_up_down
    if "mlp.experts.gate_up_proj" in weights:
        gate_up, down_w = weights.pop("mlp.experts.gate_up_proj"), weights.pop("mlp.experts.down_proj")
        dtype = dtypes["mlp.experts.gate_up_proj"]
        for e in range(gate_up.shape[0]):
            g, u = gate_up[e].chunk(2)
            for n, t in ((gate, g), (up, u), (down, down_w[e])):
                weights[f"{ex.block}.experts.{e}.{n}.weight"] = t.contiguous()
                dtypes[f"{ex.block}.experts.{e}.{n}.weight"] = dtype
        if ex.block != "mlp":   # the fused layout keeps Mixtral's router under mlp too
            weights[f"{ex.block}.gate.weight"] = weights.pop("mlp.gate.weight")
            dtypes[f"{ex.block}.gate.weight"] = dtypes["mlp.gate.weight"]
    experts = sorted({int(k.split(".")[2]) for k in weights if k.startswith(f"{ex.block}.experts.")})
    return attention + tuple(f"{ex.block}.experts.{e}.{n}" for e in experts for n in (gate, up, down))


class MoeMlp:
    """An MoE layer's MLP over the layer's weight dict (per-expert names, as moe_linears leaves them): the
    MoE op's routing (kernels/moe's route, with the lowering's attributes of DeepSeek's routings) and its
    experts' SiLU GLUs, one expert at a time (nothing stacked, so no second copy of the layer's experts), plus
    the float shared expert: behind its sigmoid gate (Qwen2-MoE), or ungated (DeepSeek's shared_experts)."""

    def __init__(self, hf: dict, linears: tuple[str, ...]):
        family = family_of(hf)
        ex = family.experts
        hf = with_defaults(hf, family)
        self.block = ex.block
        names = [n for n in linears if n.startswith(f"{ex.block}.experts.")]
        self.experts = [names[i:i + 3] for i in range(0, len(names), 3)]   # (gate, up, down)
        self.top_k = hf["num_experts_per_tok"]
        renormalize = int(bool(hf.get(ex.renormalize, False) if isinstance(ex.renormalize, str)
                               else ex.renormalize))
        self.routing = {"softmax_first": 1, "renormalize": renormalize, **_routing_attrs(hf, ex.routing)}

    def routed(self, layer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, H] -> (weights [N, k], ids [N, k]) as the MoE op routes."""
        bias = layer.w.get(f"{self.block}.gate.e_score_correction_bias")
        return route(h, layer.w[f"{self.block}.gate.weight"], self.top_k, **routing_of(self.routing, bias))

    def __call__(self, layer, h: torch.Tensor) -> torch.Tensor:
        shape, h = h.shape, h.reshape(-1, h.shape[-1])
        weights, ids = self.routed(layer, h)
        out = torch.zeros_like(h)
        for e, (gate, up, down) in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            if token.numel():
                act = F.silu(layer.linear(h[token], gate)) * layer.linear(h[token], up)
                out.index_add_(0, token, layer.linear(act, down) * weights[token, slot, None])
        if "mlp.shared_expert_gate.weight" in layer.w:
            se = "mlp.shared_expert."
            act = F.silu(layer.linear(h, se + "gate_proj")) * layer.linear(h, se + "up_proj")
            out += torch.sigmoid(layer.linear(h, "mlp.shared_expert_gate")) * layer.linear(act, se + "down_proj")
        elif "mlp.shared_experts.gate_proj.weight" in layer.w:
            w = lambda n: layer.w[f"mlp.shared_experts.{n}.weight"]  # noqa: E731
            out += glu(h, torch.cat([w("gate_proj"), w("up_proj")]), w("down_proj"))
        return out.reshape(shape)


def gptq_experts(layer, x: torch.Tensor, opts, pack) -> dict:
    """GPTQ of each expert from the calibration tokens routed to it, after the attention's stages: gate and up
    from those tokens' normed hidden states, then down from the GLU of the quantized gate and up. An expert no
    calibration token reaches has no Hessian to work from: it gets RTN."""
    from engc.compiler.quantize.gptq import Hessian, gptq_quantize
    from engc.compiler.quantize.layer import batched
    from engc.compiler.quantize.rtn import quantize_rtn
    moe = layer.moe
    h = batched(lambda xs: layer.mlp_in(xs + layer.attention(layer.attn_in(xs))), x).reshape(-1, x.shape[-1])
    _, ids = moe.routed(layer, h)
    packed = {}

    def quantize(name: str, inputs: torch.Tensor) -> None:
        w = layer.w[name + ".weight"]
        if inputs.shape[0]:
            hessian = Hessian(w.shape[1])
            hessian.add(inputs)
            qw = gptq_quantize(w, hessian.H, opts.group_size, opts.damp, opts.act_order, opts.static_groups)
        else:
            qw = quantize_rtn(w, opts.group_size)
        packed[name] = pack(qw)
        layer.w[name + ".weight"] = qw.dequantize()   # the down stage and the next layer see it quantized

    for e, (gate, up, down) in enumerate(moe.experts):
        rows = h[(ids == e).any(dim=-1)]
        quantize(gate, rows)
        quantize(up, rows)
        quantize(down, F.silu(layer.linear(rows, gate)) * layer.linear(rows, up))
    return packed
