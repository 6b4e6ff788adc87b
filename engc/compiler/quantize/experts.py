"""engc quantize of a mixture-of-experts layer: the attention projections, each expert's three and the shared
expert's three, one by one in the layer's stream; the router (and DeepSeek-V3's correction bias), Qwen2-MoE's
sigmoid gate of the shared expert (one output row) and the norms stay float. A shared expert whose width the
engc int4 layout cannot hold (not a multiple of 32 inputs to its down) stays float too, so the checkpoint
still builds (shared_linears).

RTN reads the weights alone. GPTQ quantizes each expert from the calibration tokens the router sends it, and
the shared expert from all of them (gptq_experts). AWQ searches one scale over the MLP norm's output channels
for every expert's gate and up and the shared expert's, scored on the MLP's output over all the calibration
tokens, then each expert's down scale and clipping from the tokens routed to that expert, the shared
expert's from all (awq_experts), as AutoAWQ groups Qwen2-MoE's and DeepSeek's layers. Either way the next
layer's input comes through the quantized MoE (MoeMlp, the MoE op's math on the layer's weights).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engc.compiler.frontend.block_facts import with_defaults
from engc.compiler.frontend.families import family_of
from engc.compiler.frontend.moe import _routing_attrs, expert_counts, is_moe_layer
from engc.compiler.quantize.awq import clip_projections, scale_projections, search_scale
from engc.compiler.quantize.layer import LINEARS, batched
from engc.compiler.quantize.rtn import fake_quantize
from engc.kernels.int4_linear.layout import CHUNK
from engc.kernels.moe import route, routing_of


def shared_expert(hf: dict) -> tuple[str, int] | None:
    """(the prefix of an MoE layer's shared expert, its width), None without one: Qwen2-MoE's `mlp.shared_expert.`
    behind its sigmoid gate, DeepSeek's ungated `mlp.shared_experts.` (n_shared_experts GLUs stacked as one)."""
    family = family_of(hf)
    width = expert_counts(with_defaults(hf, family), family).get("shared_expert_intermediate_size")
    if not width:
        return None
    return ("mlp.shared_experts." if family.experts.shared_experts_count_key else "mlp.shared_expert."), width


def shared_projections(hf: dict) -> tuple[str, ...]:
    """The shared expert's gate, up and down (names relative to the layer), () without one."""
    shared = shared_expert(hf)
    return tuple(shared[0] + n for n in ("gate_proj", "up_proj", "down_proj")) if shared else ()


def shared_linears(hf: dict) -> tuple[str, ...]:
    """The shared expert's projections engc quantize packs: all three where the engc int4 layout holds its down's
    inputs (a multiple of 32, as the published Qwen-MoE and DeepSeek widths are), else none (kept float, listed
    in the checkpoint's modules_to_not_convert: stream.float_modules)."""
    shared = shared_expert(hf)
    return () if shared is None or shared[1] % CHUNK else shared_projections(hf)


def moe_linears(hf: dict, layer: int, weights: dict, dtypes: dict, attention: tuple[str, ...] = LINEARS[:4]) \
        -> tuple[str, ...] | None:
    """The projections engc quantize packs in an MoE layer (None for a dense one): the attention's, then each
    expert's as HF per-expert names relative to the layer, as the family's per-expert checkpoints name them, then
    the shared expert's (shared_linears).
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
    return (attention + tuple(f"{ex.block}.experts.{e}.{n}" for e in experts for n in (gate, up, down))
            + shared_linears(hf))


class MoeMlp:
    """An MoE layer's MLP over the layer's weight dict (per-expert names, as moe_linears leaves them): the
    MoE op's routing (kernels/moe's route, with the lowering's attributes of DeepSeek's routings) and its
    experts' SiLU GLUs, one expert at a time (nothing stacked, so no second copy of the layer's experts), plus
    the shared expert: behind its sigmoid gate (Qwen2-MoE), or ungated (DeepSeek's shared_experts)."""

    def __init__(self, hf: dict, linears: tuple[str, ...]):
        family = family_of(hf)
        ex = family.experts
        hf = with_defaults(hf, family)
        self.block, self.bias = ex.block, f"{ex.block}.{ex.correction_bias}"
        names = [n for n in linears if n.startswith(f"{ex.block}.experts.")]
        self.experts = [names[i:i + 3] for i in range(0, len(names), 3)]   # (gate, up, down)
        self.shared = shared_projections(hf)
        self.quantized_shared = bool(self.shared) and self.shared[0] in linears
        self.top_k = expert_counts(hf, family)["num_experts_per_tok"]
        renormalize = int(bool(hf.get(ex.renormalize, False) if isinstance(ex.renormalize, str)
                               else ex.renormalize))
        self.routing = {"softmax_first": int(ex.softmax_first), "renormalize": renormalize,
                        **_routing_attrs(hf, ex.routing)}

    def routed(self, layer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, H] -> (weights [N, k], ids [N, k]) as the MoE op routes."""
        bias = layer.w.get(self.bias)
        return route(h, layer.w[f"{self.block}.gate.weight"], self.top_k, **routing_of(self.routing, bias))

    def __call__(self, layer, h: torch.Tensor) -> torch.Tensor:
        shape, h = h.shape, h.reshape(-1, h.shape[-1])
        out = self.routed_experts(layer, h, *self.routed(layer, h))
        if self.shared:
            out += self.shared_out(layer, h)
        return out.reshape(shape)

    def shared_out(self, layer, h: torch.Tensor, linear=None) -> torch.Tensor:
        """The shared expert's output [N, H] over h [N, H], times its sigmoid gate where it has one; each
        projection applied by linear(x, name), layer.linear unless given."""
        linear = linear or layer.linear
        gate, up, down = self.shared
        out = linear(F.silu(linear(h, gate)) * linear(h, up), down)
        if "mlp.shared_expert_gate.weight" in layer.w:
            out = out * torch.sigmoid(layer.linear(h, "mlp.shared_expert_gate"))
        return out

    def routed_experts(self, layer, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       linear=None) -> torch.Tensor:
        """The routed experts' weighted sum [N, H] over h [N, H] as routed (weights, ids [N, k]); each projection
        applied by linear(x, name), layer.linear unless given (AWQ's search passes its candidates')."""
        linear = linear or layer.linear
        out = torch.zeros_like(h)
        for e, (gate, up, down) in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            if token.numel():
                act = F.silu(linear(h[token], gate)) * linear(h[token], up)
                out.index_add_(0, token, linear(act, down) * weights[token, slot, None])
        return out

    def float_readers(self, layer) -> list[str]:
        """The float projections that read the MLP norm's output beside the quantized ones: the router, Qwen2-MoE's
        sigmoid gate of the shared expert, and the shared expert's gate and up where it stays float. AWQ
        multiplies their columns by the scale it divides the norm by, which leaves their outputs (the router's
        logits among them) as they were."""
        names = (f"{self.block}.gate", "mlp.shared_expert_gate",
                 *(() if self.quantized_shared else self.shared[:2]))
        return [n for n in names if n + ".weight" in layer.w]

    def searched(self) -> list[str]:
        """The projections AWQ's one scale over the MLP norm's output is searched for: each expert's gate and up,
        and the shared expert's where it is quantized."""
        return ([n for gate, up, _ in self.experts for n in (gate, up)]
                + list(self.shared[:2] if self.quantized_shared else ()))


def gptq_experts(layer, x: torch.Tensor, opts, pack) -> dict:
    """GPTQ of each expert from the calibration tokens routed to it, after the attention's stages: gate and up
    from those tokens' normed hidden states, then down from the GLU of the quantized gate and up. An expert no
    calibration token reaches has no Hessian to work from: it gets RTN. The shared expert, which every token
    reaches, the same way from all of them."""
    from engc.compiler.quantize.gptq import Hessian, gptq_quantize
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

    def quantize_glu(gate: str, up: str, down: str, rows: torch.Tensor) -> None:
        quantize(gate, rows)
        quantize(up, rows)
        quantize(down, F.silu(layer.linear(rows, gate)) * layer.linear(rows, up))

    for e, names in enumerate(moe.experts):
        quantize_glu(*names, h[(ids == e).any(dim=-1)])
    if moe.quantized_shared:
        quantize_glu(*moe.shared, h)
    return packed


def awq_experts(layer, x: torch.Tensor, group_size: int, grid: int = 20) -> None:
    """AWQ of an MoE layer's MLP after its attention's (awq.awq_attention), as AutoAWQ does Mixtral's,
    Qwen-MoE's and DeepSeek's; rewrites layer.w in place. One scale s over the MLP norm's output channels for
    every expert's gate and up and the quantized shared expert's (MoeMlp.searched), scored on the MLP's output
    (the routed experts' weighted sum plus the shared expert's) over all the calibration tokens with those
    projections fake-quantized; folded into the norm and those projections, and into the float readers of the
    norm (float_readers). A float shared expert adds the same output to every candidate and to the reference,
    so it is left out of the search's sum. Then, expert by expert on the tokens routed to it (the shared expert
    on all of them), its down's scale (from its GLU's output, folded into its up's rows) and the clipping of
    its three projections. An expert no calibration token reaches keeps s = 1 at its down and its weights
    unclipped: plain RTN, as gptq_experts gives it."""
    moe, w = layer.moe, layer.w
    x_mid = batched(lambda xs: xs + layer.attention(layer.attn_in(xs)), x)
    h = batched(layer.mlp_in, x_mid).reshape(-1, x.shape[-1])
    weights, ids = moe.routed(layer, h)
    gate_up = moe.searched()
    searched = set(gate_up)

    def mlp_out(linear=None) -> torch.Tensor:
        out = moe.routed_experts(layer, h, weights, ids, linear)
        return out + moe.shared_out(layer, h, linear) if moe.quantized_shared else out

    def loss(s: torch.Tensor) -> float:
        def linear(inp: torch.Tensor, name: str) -> torch.Tensor:
            # an expert's candidate is made when its tokens are reached and freed after: never all experts' at once
            weight = w[name + ".weight"]
            if name in searched:
                weight = fake_quantize(weight * s, group_size).div_(s)
            return F.linear(inp, weight, w.get(name + ".bias"))
        return (mlp_out(linear) - reference).pow(2).mean().item()

    with torch.no_grad():
        reference = mlp_out()
        s = search_scale(h, (w[n + ".weight"] for n in gate_up), loss, group_size, grid)
        del reference
    for n in gate_up + moe.float_readers(layer):
        w[n + ".weight"] = w[n + ".weight"] * s
    layer.divide_norm(layer.mlp_norm, s)
    h = batched(layer.mlp_in, x_mid).reshape(-1, x.shape[-1])   # the norm's output as folded: h / s
    weights, ids = moe.routed(layer, h)   # the fold left the routing as it was (test_moe_quantize checks)

    glus = [(names, (ids == e).any(dim=-1)) for e, names in enumerate(moe.experts)]
    if moe.quantized_shared:
        glus.append((moe.shared, None))   # every token
    for (gate, up, down), routed in glus:
        rows = h if routed is None else h[routed]
        if not rows.shape[0]:
            continue
        act = F.silu(layer.linear(rows, gate)) * layer.linear(rows, up)
        scale_projections(layer, up, [down], act, lambda inp, down=down: layer.linear(inp, down), group_size, grid)
        act = F.silu(layer.linear(rows, gate)) * layer.linear(rows, up)
        clip_projections(layer, ((gate, rows), (up, rows), (down, act)), group_size, grid)
