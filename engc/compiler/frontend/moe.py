"""The mixture-of-experts MLP of a decoder layer: one ai.engc::MoE node whatever the family.

A family's Experts facts (families.py) say where config.json and the checkpoint keep the routing and the
expert weights; the routing variant becomes the node's attributes (kernels/moe). Expert weights are
stacked for the kernels: gate_up [E, 2I, H] (each expert's gate rows, then its up rows) and down [E, H, I],
from either layout transformers uses: one tensor per expert and projection (experts.{e}.gate_proj, Mixtral's
w1/w3/w2) or the fused experts.gate_up_proj / experts.down_proj of recent transformers. A shared expert
(Qwen2-MoE's, DeepSeek's) is the dense MLP's GLU beside the node, whose output the node adds (behind
Qwen2-MoE's sigmoid gate): so it takes the paths a dense projection takes (the decode GEMVs, int4; --quant
fp8 leaves it in the model dtype, passes/quantize_fp8 says why).
"""
from __future__ import annotations

import torch

from engc.compiler.frontend.block_facts import with_defaults
from engc.compiler.frontend.families import Family
from engc.compiler.ir import Graph
from engc.errors import UserError

# config.json keys of variants the MoE lowering does not compute, with the values it does compute (a key
# absent or null is fine): the refusal names the key, its value and what is supported
_VARIANTS = {
    "scoring_func": ("softmax",),          # DeepSeek-V3 / GLM-4.5 route by sigmoid scores
    "topk_method": ("greedy",),            # group-limited top-k (DeepSeek)
    "n_group": (1,),
    "topk_group": (1,),
    "routed_scaling_factor": (1,),
    "moe_router_bias": (False,),
    "use_routing_bias": (False,),          # MiniMax's e_score_correction_bias
    "hidden_act": ("silu",),               # the experts' GLU is SiLU
    "clip_qkv": (),                        # OLMoE's optional q/k/v clamp
}
# what DeepSeek's routings compute in place of the keys above (Experts.routing; the MoE node's attributes)
_ROUTINGS = {
    "deepseek_v2": {"scoring_func": ("softmax",), "topk_method": ("greedy", "group_limited_greedy")},
    "deepseek_v3": {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)},
    "ernie4_5": {},
}
_ROUTING_OWNS = ("scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor")


def expert_counts(hf: dict, family: Family) -> dict:
    """The ModelConfig fields of an MoE family (all zero for a dense one); refuses a routing it cannot compute."""
    ex = family.experts
    if ex is None:
        return {}
    variants = _VARIANTS if ex.routing is None else {
        **{k: v for k, v in _VARIANTS.items() if k not in _ROUTING_OWNS}, **_ROUTINGS[ex.routing]}
    for key, supported in variants.items():
        if hf.get(key) is not None and hf[key] not in supported:
            raise UserError(f"unsupported MoE variant: {key} = {hf[key]!r} in config.json (engc computes "
                            f"{' or '.join(repr(s) for s in supported) if supported else 'only its absence'})")
    experts = (hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
               or hf.get("moe_num_experts"))
    top_k = hf.get("num_experts_per_tok") or hf.get("moe_k")
    inter = hf.get(ex.intermediate_key)
    if not experts or not top_k or not inter:
        missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", top_k),
                                  (ex.intermediate_key, inter)) if not v]
        raise UserError(f"config.json lacks {', '.join(missing)}, needed for a {family.name} model")
    if not 1 <= top_k <= experts:
        raise UserError(f"num_experts_per_tok {top_k} is not between 1 and num_experts {experts}")
    shared = hf.get(ex.shared_expert_key, 0) if ex.shared_expert_key else 0
    if ex.shared_experts_count_key:
        shared = int(hf.get(ex.shared_experts_count_key) or 0) * int(inter)
    if ex.routing:
        groups, chosen = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
        if experts % groups or not 1 <= chosen <= groups:
            raise UserError(f"n_group {groups} and topk_group {chosen} do not split {experts} experts into groups")
        if ex.routing == "deepseek_v3" and experts // groups < 2:
            raise UserError(f"noaux_tc routing scores each group by its best two experts; n_group {groups} leaves "
                            f"{experts // groups} a group")
    return dict(num_experts=int(experts), num_experts_per_tok=int(top_k), moe_intermediate_size=int(inter),
                shared_expert_intermediate_size=int(shared or 0), moe_scored_routing=ex.routing is not None)


def is_moe_layer(hf: dict, family: Family, layer: int) -> bool:
    """Qwen-MoE keeps a dense MLP on the layers in mlp_only_layers and off every decoder_sparse_step-th;
    DeepSeek on its first first_k_dense_replace layers."""
    if family.experts is None:
        return False
    if family.experts.first_dense_key:
        return layer >= int(with_defaults(hf, family).get(family.experts.first_dense_key) or 0)
    if family.experts.layer_range_keys:   # ERNIE 4.5: an end index below 0 is the last layer
        start, end, every = (with_defaults(hf, family).get(k) for k in family.experts.layer_range_keys)
        end = hf["num_hidden_layers"] - 1 if end is None or end < 0 else end
        return int(start or 0) <= layer <= end and (layer + 1) % int(every or 1) == 0
    if not family.experts.dense_layers:
        return True
    step = hf.get("decoder_sparse_step") or 1
    return layer not in (hf.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def lower_moe(g: Graph, h: str, ckpt, weight, family: Family, hf: dict, layer: int, dtype: torch.dtype,
              mlp) -> str:
    """Emits the MoE node of one layer on the normed hidden state h; returns its output (residual excluded).
    mlp(h, prefix, hf_prefix, width) lowers a dense GLU (the decoder's): the shared expert's."""
    ex = family.experts
    hf = with_defaults(hf, family)
    counts = expert_counts(hf, family)
    block, p = f"model.layers.{layer}.{ex.block}.", f"layers.{layer}."
    routing = _routing_attrs(hf, ex.routing)
    own_bias = (ex.correction_bias,) if routing.get("correction_bias") else ()
    for bias in ("gate.bias", "gate.e_score_correction_bias", "experts.gate_up_proj_bias"):
        if bias in own_bias:
            continue
        if ckpt.has(block + bias) or ckpt.has(f"model.layers.{layer}.mlp.{bias}"):
            raise UserError(f"unsupported MoE variant: the checkpoint has '{block}{bias}' (router or expert "
                            "biases are not computed)")
    fused = f"model.layers.{layer}.mlp.experts."
    gate, up, down = ex.gate_up_down
    per = [f"{block}experts.{e}." for e in range(counts["num_experts"])]
    int4 = {}
    if ckpt.has(fused + "gate_up_proj"):   # transformers 5's layout (Mixtral's block renamed to mlp there)
        _check_present(ckpt, fused + "down_proj")
        router_name = f"model.layers.{layer}.mlp.gate.weight"
        g.weights[p + "experts.gate_up"] = lambda: ckpt.get(fused + "gate_up_proj").to(dtype).contiguous()
        g.weights[p + "experts.down"] = lambda: ckpt.get(fused + "down_proj").to(dtype).contiguous()
    elif ckpt.has(f"{per[0]}{gate}.qweight"):   # an int4 checkpoint (engc quantize's, AutoAWQ's, GPTQ's)
        router_name = block + "gate.weight"
        int4 = _int4_experts(g, ckpt, per, ex.gate_up_down, p, dtype, weight.quant_config)
    else:
        for e in per:
            for n in (gate, up, down):
                _check_present(ckpt, f"{e}{n}.weight")
        router_name = block + "gate.weight"
        g.weights[p + "experts.gate_up"] = lambda: torch.stack([torch.cat(
            [ckpt.get(f"{e}{gate}.weight"), ckpt.get(f"{e}{up}.weight")]).to(dtype) for e in per])
        g.weights[p + "experts.down"] = lambda: torch.stack([ckpt.get(f"{e}{down}.weight").to(dtype)
                                                             for e in per])
    inputs = [h, weight(p + "router.weight", router_name), p + "experts.gate_up", p + "experts.down"]
    shared = counts["shared_expert_intermediate_size"] > 0
    gated = ex.shared_experts_count_key is None   # Qwen2-MoE's shared expert has a sigmoid gate; DeepSeek's none
    if shared:   # a dense GLU of its own (any weight form the dense MLP takes), its output added by the node
        se = f"model.layers.{layer}.mlp.{'shared_expert' if gated else 'shared_experts'}."
        inputs.append(mlp(h, p + "shared_expert.", se, counts["shared_expert_intermediate_size"]))
        if gated:
            inputs.append(weight(p + "shared_expert_gate.weight",
                                 f"model.layers.{layer}.mlp.shared_expert_gate.weight"))
    renormalize = hf.get(ex.renormalize, False) if isinstance(ex.renormalize, str) else ex.renormalize
    if own_bias:   # the router's correction bias: the node's last input, float32 as HF keeps it
        _check_present(ckpt, block + own_bias[0])
        g.weights[p + "router.bias"] = lambda: ckpt.get(block + own_bias[0]).float().reshape(-1).contiguous()
    return g.add("MoE", inputs + int4.get("inputs", []) + ([p + "router.bias"] if own_bias else []), p + "moe",
                 num_experts=counts["num_experts"], top_k=counts["num_experts_per_tok"],
                 softmax_first=ex.softmax_first, renormalize=bool(renormalize), has_shared_expert=shared,
                 **({"shared_ungated": True} if shared and not gated else {}), **routing,
                 **({"group_size": int4["group_size"]} if int4 else {}),
                 **({"float32_weights": True} if ex.float32_weights else {}))


def _routing_attrs(hf: dict, routing: str | None) -> dict:
    """The MoE node's attributes of DeepSeek's routings (kernels/moe's route); none for plain softmax top-k."""
    if routing is None:
        return {}
    grouped = routing == "deepseek_v3" or hf.get("topk_method") == "group_limited_greedy"
    attrs = {"routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0)}
    if routing == "ernie4_5":   # softmax scores, the correction bias choosing; no groups
        return {**attrs, "correction_bias": True}
    if routing == "deepseek_v3":
        attrs.update(sigmoid_scores=True, correction_bias=True)
    if grouped and int(hf.get("n_group") or 1) > 1:
        attrs.update(n_group=int(hf["n_group"]), topk_group=int(hf.get("topk_group") or 1),
                     group_top2=routing == "deepseek_v3")
    return attrs


def _int4_experts(g: Graph, ckpt, per: list[str], names: tuple, p: str, dtype: torch.dtype, qc: dict) -> dict:
    """int4 experts (frontend/quantized.py gives each expert projection in the engc int4 layout), stacked:
    qweight [E, N, K / 8] as the float path's gate_up / down, their scales [E, N, K / g] (model dtype) and
    zeros [E, N, K / g] (uint8) as the node's last four inputs."""
    group = int(qc.get("group_size", 128))
    if group <= 0:
        raise UserError("int4 experts quantized per channel (group_size -1) are not supported")
    for e in per:
        for n in names:
            for key in ("qweight", "scales", "zeros"):
                _check_present(ckpt, f"{e}{n}.{key}")
            if ckpt.has(f"{e}{n}.perm"):
                raise UserError(f"int4 experts with act-order (desc_act) are not supported: '{e}{n}' has g_idx")
    gate, up, down = names

    def stacked(projections: tuple, key: str, cast: bool):
        def load():
            t = torch.stack([torch.cat([ckpt.get(f"{e}{n}.{key}") for n in projections]) for e in per])
            return (t.to(dtype) if cast else t).contiguous()
        return load

    for part, projections in (("gate_up", (gate, up)), ("down", (down,))):
        g.weights[f"{p}experts.{part}"] = stacked(projections, "qweight", False)
        g.weights[f"{p}experts.{part}.scales"] = stacked(projections, "scales", True)
        g.weights[f"{p}experts.{part}.zeros"] = stacked(projections, "zeros", False)
    return {"group_size": group, "inputs": [f"{p}experts.{part}.{key}" for part in ("gate_up", "down")
                                           for key in ("scales", "zeros")]}


def _check_present(ckpt, name: str) -> None:
    if not ckpt.has(name):
        raise UserError(f"checkpoint {ckpt.name} is missing tensor '{name}'")
