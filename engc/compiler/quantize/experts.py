"""engc quantize of a mixture-of-experts layer: the attention projections and each expert's three, one by one
in the layer's stream (RTN); the router, the norms and the shared expert stay float.

AWQ and GPTQ need each expert's own calibration inputs (the tokens routed to it) run through the layer's
MoE, which the plain-torch layer (layer.py) does not compute yet: they are refused for MoE models.
"""
from __future__ import annotations

from engc.compiler.frontend.families import family_of
from engc.compiler.frontend.moe import is_moe_layer
from engc.compiler.quantize.layer import LINEARS

ATTENTION = LINEARS[:4]


def moe_linears(hf: dict, layer: int, weights: dict, dtypes: dict) -> tuple[str, ...] | None:
    """The projections engc quantize packs in an MoE layer (None for a dense one), as HF per-expert names
    relative to the layer, as the family's per-expert checkpoints name them. Fused experts (transformers'
    experts.gate_up_proj / down_proj) in `weights` are split into those names in place, so the written
    checkpoint has one int4 projection per expert, as AutoAWQ and GPTQ tools write MoE models (dtypes, the
    source dtype of each name, learns the new names)."""
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
    return ATTENTION + tuple(f"{ex.block}.experts.{e}.{n}" for e in experts for n in (gate, up, down))
