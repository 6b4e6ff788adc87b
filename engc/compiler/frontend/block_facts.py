"""What a family's decoder block computes beyond Llama's, resolved from config.json into ModelConfig fields.

A family's facts (families.py) say which keys to read; the values become ModelConfig fields that the
lowering (decoder.py) turns into node attributes and weights. Anything a key asks for that engc does not
compute is refused here, with the key named.
"""
from __future__ import annotations

from engc.compiler.frontend.families import Family
from engc.compiler.frontend.rope import attention_factor, context_limit, layer_type_rope
from engc.errors import UserError

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("sliding_attention", "full_attention")


def with_defaults(hf: dict, family: Family) -> dict:
    """config.json over the family's transformers defaults; refuses keys set to what engc cannot compute."""
    for key in family.refused_true:
        if hf.get(key):
            raise UserError(f"config.json sets {key}: true for a {family.name} model, which engc does not "
                            "support (a bias it has no input for)")
    if hf.get("use_bidirectional_attention"):
        raise UserError("config.json sets use_bidirectional_attention: true; engc builds causal decoders only")
    return {**dict(family.defaults), **hf}


def block_facts(hf: dict, family: Family, head_dim: int, window: int, max_positions: int,
                scaling: dict | None) -> dict:
    """ModelConfig fields beyond the Llama ones (and the ones these families resolve otherwise)."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise UserError(f"config.json hidden activation '{act}' is not supported; supported: {', '.join(ACTIVATIONS)}")
    facts = dict(hidden_act=act, qkv_bias=family.qkv_bias or bool(hf.get(family.qkv_bias_key, False)),
                 attn_logit_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
                 final_logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
                 norm_unit_offset=family.norm_unit_offset, sandwich_norms=family.sandwich_norms,
                 pre_norms=family.pre_norms)
    if family.scaled_embedding:
        facts["embed_scale"] = hf["hidden_size"] ** 0.5
    scale = hf["query_pre_attn_scalar"] ** -0.5 if "query_pre_attn_scalar" in hf else head_dim ** -0.5
    if family.sliding_window_pattern:   # the global layers' rope is the scaled one (_interleaved: the local ones')
        scaling = layer_type_rope(hf, "full_attention")[1]
    if scaling is not None and scaling.get("original_max_position_embeddings") is None \
            and hf.get("original_max_position_embeddings"):
        scaling = {**scaling, "original_max_position_embeddings": hf["original_max_position_embeddings"]}
    if scale != head_dim ** -0.5:
        facts["attn_scale"] = scale
    factor = attention_factor(scaling, max_positions)
    if factor != 1.0:
        facts["rope_attention_factor"] = factor
    facts["rope_scaling"] = scaling
    facts["max_position_embeddings"] = context_limit(scaling, max_positions)
    rotary = rotary_dim(hf, head_dim)
    if rotary != head_dim:
        facts["rotary_dim"] = rotary
    if family.rope_interleave is True and not family.latent_attention:   # latent attention's are mla.py's
        facts["rotary_interleaved"] = True
    if family.multipliers:   # Granite's: its attention_multiplier is the scale itself, whatever head_dim is
        facts.update(attn_scale=float(hf["attention_multiplier"]), residual_scale=float(hf["residual_multiplier"]),
                     logit_scale=1.0 / float(hf["logits_scaling"]))
        if float(hf["embedding_multiplier"]) != 1.0:
            facts["embed_scale"] = float(hf["embedding_multiplier"])
    if family.cohere:
        facts.update(layer_norm=True, parallel_block=True, rms_norm_eps=float(hf["layer_norm_eps"]),
                     logit_scale=float(hf["logit_scale"]))
    if family.qk_norm_key and hf.get(family.qk_norm_key):
        facts["qk_norm"] = True
    if family.nope_layers:
        facts.update(_nope(hf, window))
    if family.sliding_window_pattern:
        facts.update(_interleaved(hf, family, window))
    if family.nope_global_layers:
        facts.update(_nope_global(hf, family, facts, window))
    return facts


def _nope_global(hf: dict, family: Family, facts: dict, window: int) -> dict:
    """The NoPE layers of a hybrid whose global layers rotate nothing (EXAONE 4, Cohere 2)."""
    layers = hf["num_hidden_layers"]
    if hf.get("sliding_window") is None:   # no layer has a window: EXAONE 4 rotates them all, Cohere 2 none
        return {"nope_layers": tuple(range(layers))} if family.nope_global_layers == "always" else {}
    windows = facts.get("layer_windows") or (0,) * layers
    if not window:   # a window as long as the context: every layer is global (engc's window 0), and
        types = hf.get("layer_types") or ()   # config.json's layer_types still says which ones rotate
        windows = tuple(int(t == "sliding_attention") for t in types) or windows
    return {"nope_layers": tuple(i for i, w in enumerate(windows) if not w)}


def _nope(hf: dict, window: int) -> dict:
    """SmolLM3's layers without rotary embedding (NoPE) and, where a window is on, the layers it applies to."""
    layers = hf["num_hidden_layers"]
    rotates = hf.get("no_rope_layers")
    if rotates is None:
        every = int(hf["no_rope_layer_interval"])
        rotates = [int((i + 1) % every != 0) for i in range(layers)]
    if len(rotates) < layers or any(r not in (0, 1) for r in rotates[:layers]):
        raise UserError(f"config.json no_rope_layers must give 0 or 1 for each of the {layers} layers")
    facts = {"nope_layers": tuple(i for i in range(layers) if not rotates[i])}
    if window:
        types = hf.get("layer_types") or ["full_attention" if r else "sliding_attention" for r in rotates[:layers]]
        if len(types) != layers or any(t not in LAYER_TYPES for t in types):
            raise UserError(f"config.json layer_types must list {layers} of {', '.join(LAYER_TYPES)}")
        facts["layer_windows"] = tuple(window if t == "sliding_attention" else 0 for t in types)
    return facts


def rotary_dim(hf: dict, head_dim: int) -> int:
    params = hf.get("rope_parameters") or {}
    factor = hf.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    dim = int(head_dim * factor)
    if dim % 2 or dim <= 0 or dim > head_dim:
        raise UserError(f"partial_rotary_factor {factor} gives a rotary width {dim} for head_dim {head_dim}")
    return dim


def _interleaved(hf: dict, family: Family, window: int) -> dict:
    """Local (sliding window) and global layers and their rope bases (Gemma 2 and 3, OLMo 3, EXAONE 4, Cohere 2);
    block_facts takes the global layers' scaling, its attention factor and context limit."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("sliding_window_pattern") or family.sliding_window_pattern
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise UserError(f"config.json layer_types must list {layers} of {', '.join(LAYER_TYPES)}")
    facts = {"layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types)}
    theta, scaling = layer_type_rope(hf, "full_attention")
    facts["rope_theta"] = theta
    local_theta, local_scaling = layer_type_rope(hf, "sliding_attention")
    if local_scaling is not None:
        raise UserError("rope scaling on the sliding-window layers is not supported")
    # the local layers get a table of their own where their rope differs: another base (Gemma 3), or the same
    # base without the global layers' scaling (OLMo 3's YaRN)
    if "sliding_attention" in types and (local_theta != theta or scaling is not None):
        facts["local_rope_theta"] = local_theta
    return facts
