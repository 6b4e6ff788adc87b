"""Lowers any supported decoder-only family to the engine program.

The families differ in a few facts (families.py); everything else here is shared. The lowered graph
is deliberately unfused (one Gemm per projection, joined by Concat): fusion is the passes' job.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler.frontend.checkpoint import Checkpoint
from engc.compiler.frontend.block_facts import block_facts, with_defaults
from engc.compiler.frontend.families import Family, family_of
from engc.compiler.frontend.layouts import llama_names, text_config, text_part
from engc.compiler.frontend.mla import lower_mla, mla_facts
from engc.compiler.frontend.moe import expert_counts, is_moe_layer, lower_moe
from engc.compiler.frontend.rope import inv_freq, rope_params
from engc.compiler.ir import Graph
from engc.errors import UserError


def resolve_config(hf: dict) -> ModelConfig:
    family = family_of(hf)
    if family.text_config:
        return resolve_config(text_config(hf))
    hf = with_defaults(hf, family)
    try:
        heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        theta, scaling = rope_params(hf)
        eos = hf.get("eos_token_id")
        cfg = ModelConfig(
            family=family.name, vocab_size=hf["vocab_size"], hidden_size=hidden,
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias or bool(hf.get("attention_bias", False)),
            qk_norm=family.qk_norm, qk_norm_projection=family.qk_norm_projection, rope_scaling=scaling,
            sliding_window=_sliding_window(hf, family),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            **expert_counts(hf, family))
        cfg = dataclasses.replace(cfg, **block_facts(hf, family, cfg.head_dim, cfg.sliding_window,
                                                     cfg.max_position_embeddings, scaling))
        return dataclasses.replace(cfg, **mla_facts(hf)) if family.latent_attention else cfg
    except KeyError as e:
        raise UserError(f"config.json lacks {e.args[0]}, needed for a {family.name} model") from None


def _sliding_window(hf: dict, family: Family) -> int:
    window = hf.get("sliding_window") or 0
    if family.sliding_window_switch is not None and not hf.get(family.sliding_window_switch, False):
        return 0
    if window and hf.get("max_window_layers") not in (None, 0, hf.get("num_hidden_layers")):
        raise UserError("sliding window on only some layers (max_window_layers) is not supported")
    return window if window and window < hf.get("max_position_embeddings", 1 << 30) else 0


def lower(ckpt: Checkpoint, dtype: torch.dtype) -> tuple[ModelConfig, Graph]:
    if family_of(ckpt.hf_config).text_config:
        ckpt = text_part(ckpt)
    cfg = resolve_config(ckpt.hf_config)
    family = family_of(ckpt.hf_config)
    if cfg.num_heads % cfg.num_kv_heads:
        raise UserError(f"num_attention_heads {cfg.num_heads} is not a multiple of "
                        f"num_key_value_heads {cfg.num_kv_heads}")
    ckpt = llama_names(ckpt, family.layout, cfg, cfg.rotary_dim or cfg.head_dim,
                       cfg.rope_attention_factor).tracked()
    g = Graph(num_layers=cfg.num_layers, dtype=str(dtype).removeprefix("torch."))
    weight = _weight_binder(ckpt, g, dtype)
    rope = _rope_table(cfg, cfg.rope_theta, cfg.rope_scaling)
    g.weights["rope.inv_freq"] = lambda: rope
    if cfg.local_rope_theta:
        local_rope = _rope_table(cfg, cfg.local_rope_theta, None)
        g.weights["rope.local.inv_freq"] = lambda: local_rope
    if cfg.nope_layers:   # NoPE layers rotate by angle 0: cos 1, sin 0 leave q and k exactly as they are
        g.weights[NOPE_ROPE] = lambda: torch.zeros_like(rope)
    norm = _norms(g, weight, cfg, dtype)
    pre_norm = norm if cfg.pre_norms else functools.partial(_residual_sum, g)
    mlp = functools.partial(_mlp, g, weight, cfg)

    embed = weight("embed.weight", EMBED)
    x = g.onnx_op("Gather", [embed, "input_ids"], "h.embed", axis=0)
    if cfg.embed_scale:
        # HF multiplies by sqrt(hidden_size) rounded to the model dtype (Gemma); Granite's embedding_multiplier
        # rounds so too, the same product as HF's wherever the dtype holds the multiplier (a whole number does)
        scale = torch.tensor([cfg.embed_scale], dtype=torch.float32).to(dtype)
        g.weights["embed.scale"] = lambda: scale
        x = g.onnx_op("Mul", [x, "embed.scale"], "h.embed.scaled")
    residual = None
    for i in range(cfg.num_layers):
        hf, p = f"model.layers.{i}.", f"layers.{i}."
        h, residual = pre_norm(x, residual, p + "attn_norm.weight", hf + "input_layernorm.weight", f"{p}attn_in")
        if family.latent_attention:   # DeepSeek's MLA: frontend/mla.py, then the MLP as for every family
            x = lower_mla(g, h, weight, cfg, ckpt.hf_config, family, i, dtype)
        else:
            x = _attention(g, h, weight, norm, cfg, family, i)
        if cfg.parallel_block:   # Cohere: the MLP reads the attention's input; both outputs join the residual
            x = g.onnx_op("Add", [x, mlp(h, p, hf + "mlp.", cfg.intermediate_size)], f"{p}attn_mlp")
            continue
        h, residual = pre_norm(x, residual, p + "mlp_norm.weight", hf + ("pre_feedforward_layernorm.weight"
                               if cfg.sandwich_norms else "post_attention_layernorm.weight"), f"{p}mlp_in")
        if is_moe_layer(ckpt.hf_config, family, i):
            x = lower_moe(g, h, ckpt, weight, family, ckpt.hf_config, i, dtype, mlp)
            _scale_output(g, p + "experts.down", cfg.residual_scale)   # Granite MoE's residual multiplier
            continue
        x = mlp(h, p, hf + "mlp.", cfg.intermediate_size)
        _scale_output(g, p + "down", cfg.residual_scale)
        if cfg.sandwich_norms:
            x = norm(x, None, p + "mlp_out_norm.weight", hf + "post_feedforward_layernorm.weight", f"{p}mlp_out")[0]

    h, _ = norm(x, residual, "norm.weight", "model.norm.weight", "final")
    _refuse_unread(ckpt, cfg)
    return _head(g, h, ckpt, weight, embed, cfg)


# layer tensors that are not weights of the network: rotary tables some checkpoints saved
_NOT_WEIGHTS = (".rotary_emb.inv_freq",)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _refuse_unread(ckpt: Checkpoint, cfg: ModelConfig) -> None:
    """A layer's tensor the lowering never asked for is a part of the network it leaves out (a bias on o_proj or
    the MLP, a norm some config key adds): refused, rather than built into a model that computes something
    else. An all-zero one (a zero bias) changes nothing and passes; layers past num_hidden_layers (DeepSeek-V3's
    multi-token prediction layer) are not the decoder's."""
    unread = [n for n in ckpt.names() if n not in ckpt.asked and not n.endswith(_NOT_WEIGHTS)
              and (m := _LAYER.match(n)) and int(m.group(1)) < cfg.num_layers]
    # loaded one by one, only until the first that is not all zeros (an unsupported module can be GBs)
    first = next((n for n in unread if ckpt.loaders[n]().count_nonzero()), None)
    if first is not None:
        more = f" (of {len(unread)} tensors it does not read)" if len(unread) > 1 else ""
        raise UserError(f"checkpoint {ckpt.name} has tensor '{first}'{more}, which engc's {cfg.family} model "
                        "does not compute (a variant of the family engc does not support)")


def _mlp(g: Graph, weight, cfg: ModelConfig, h: str, p: str, hf: str, width: int) -> str:
    """A GLU MLP (gate and up, the activation, down) on h: a dense layer's, or an MoE layer's shared expert
    (p and hf its prefixes, width its intermediate size)."""
    gate_up = _concat(g, [_linear(g, h, weight, p + n, f"{hf}{n}_proj", False, cfg.hidden_size)
                          for n in ("gate", "up")], p + "gate_up")
    act = g.add(ACTIVATION_OPS[cfg.hidden_act], [gate_up], p + "act")
    return _linear(g, act, weight, p + "down", hf + "down_proj", False, width)


def _attention(g: Graph, h: str, weight, norm, cfg: ModelConfig, family: Family, i: int) -> str:
    """One layer's attention (q/k/v, rotary, paged attention, o_proj) on the normed hidden state h."""
    hf, p, eps = f"model.layers.{i}.", f"layers.{i}.", cfg.rms_norm_eps
    qkv_parts = [_linear(g, h, weight, p + n, hf + f"self_attn.{n}_proj", cfg.qkv_bias, cfg.hidden_size)
                 for n in ("q", "k", "v")]
    if family.qk_norm_projection:
        qkv_parts[:2] = [g.add("RMSNorm", [part, weight(f"{p}{n}_norm.weight", f"{hf}self_attn.{n}_norm.weight")],
                               f"{p}{n}.normed", eps=eps) for n, part in zip("qk", qkv_parts)]
    qkv = _concat(g, qkv_parts, p + "qkv")
    if cfg.qk_norm:   # per head; Cohere's LayerNorm has a weight per head ([heads, head_dim])
        op = "QKLayerNorm" if cfg.layer_norm else "QKNorm" + norm.variant
        qkv = g.add(op, [qkv, norm.weight(p + "q_norm.weight", hf + "self_attn.q_norm.weight"),
                         norm.weight(p + "k_norm.weight", hf + "self_attn.k_norm.weight")],
                    p + "qkv.normed", num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim, eps=eps)
    heads = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    window = cfg.layer_windows[i] if cfg.layer_windows else cfg.sliding_window
    nope = i in cfg.nope_layers
    rope_name = NOPE_ROPE if nope else "rope.local.inv_freq" if cfg.local_rope_theta and window else "rope.inv_freq"
    scaled = rope_name == "rope.inv_freq"   # the global table, which carries the rope scaling
    q = g.add("RotaryKVWrite", [qkv, "positions", rope_name, f"kv_cache.{i}", "slot_mapping"],
              p + "q.rot", **heads)
    softcap = {"softcap": cfg.attn_logit_softcap} if cfg.attn_logit_softcap else {}
    # the rope scaling's attention factor (LongRoPE, YaRN) scales the rotated dims of q and k: only where the
    # layer's table is the scaled one (not a NoPE layer's, nor a local layer's unscaled table)
    attn = g.add("PagedAttention", [q, f"kv_cache.{i}", "block_tables", "context_lens",
                                    "query_start_loc"], p + "attn",
                 scale=(cfg.attn_scale or cfg.head_dim ** -0.5) * (cfg.rope_attention_factor ** 2 if scaled else 1.0),
                 sliding_window=window, **softcap, **heads)
    x = _linear(g, attn, weight, p + "o", hf + "self_attn.o_proj", False, cfg.q_size)
    _scale_output(g, p + "o", cfg.residual_scale)
    if cfg.sandwich_norms:   # Gemma: the attention output is normed before the residual add
        x = norm(x, None, p + "attn_out_norm.weight", hf + "post_attention_layernorm.weight", f"{p}attn_out")[0]
    return x


def _head(g: Graph, h: str, ckpt: Checkpoint, weight, embed: str, cfg: ModelConfig):
    """The final rows' logits (float32), and the config as the head leaves it."""
    sampled = g.onnx_op("Gather", [h, "logits_indices"], "h.sampled", axis=0)
    if ckpt.has("lm_head.qweight"):
        # an int4 lm_head (GPTQModel's `lm_head: true`): the same QLinear as the projections, and untied
        # even where config.json ties it, since the embedding stays the float gather table
        logits = _qlinear(g, sampled, weight, "lm_head", "lm_head", False, cfg.hidden_size)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    else:
        head = embed if head_source(ckpt, cfg) == EMBED else weight("lm_head.weight", "lm_head.weight")
        logits = g.onnx_op("Gemm", [sampled, head], "logits.raw", transB=1)
    if cfg.final_logit_softcap:   # Gemma 2: in the model dtype, before the float32 cast, as HF rounds it
        logits = g.add("LogitSoftcap", [logits], "logits.capped", cap=cfg.final_logit_softcap)
    # Granite's division by logits_scaling, Cohere's logit_scale: HF's rounding wherever the dtype holds the
    # factor exactly (a power of two does)
    if cfg.logit_scale != 1.0:
        scale = torch.tensor([cfg.logit_scale], dtype=torch.float32).to(getattr(torch, g.dtype))
        g.weights["logits.scale"] = lambda: scale
        logits = g.onnx_op("Mul", [logits, "logits.scale"], "logits.scaled")
    g.onnx_op("Cast", [logits], "logits", to=1)  # float32 logits for sampling
    return cfg, g


EMBED = "model.embed_tokens.weight"
NOPE_ROPE = "rope.none.inv_freq"   # the NoPE layers' rope table: zeros
# the GLU of the MLP by config.json's activation (block_facts.ACTIVATIONS)
ACTIVATION_OPS = {"silu": "SiluMul", "gelu_pytorch_tanh": "GeluTanhMul"}


def _rope_table(cfg: ModelConfig, theta: float, scaling: dict | None) -> torch.Tensor:
    """inv_freq [head_dim / 2]: a partial rotary width's frequencies, then zeros for the unrotated dims
    (layouts.partial_rotary_order moved them there). Latent attention: [qk_rope_head_dim / 2], its rope key's."""
    if cfg.qk_rope_head_dim:
        return inv_freq(cfg.qk_rope_head_dim, theta, scaling)
    freq = inv_freq(cfg.rotary_dim or cfg.head_dim, theta, scaling)
    return torch.cat([freq, freq.new_zeros(cfg.head_dim // 2 - freq.numel())])


def _norms(g: Graph, weight, cfg: ModelConfig, dtype: torch.dtype):
    """norm(x, residual, name, hf_name, out) -> (normed, residual) with the family's RMSNorm. Gemma's
    (1 + weight) is folded into the weight where that is exact, in float32 (HF adds 1 in float32); in
    half precision the *UnitOffset ops add it in float32 themselves, as HF does."""
    fold = cfg.norm_unit_offset and dtype == torch.float32
    variant = "UnitOffset" if cfg.norm_unit_offset and not fold else ""
    ops = ("LayerNorm", "AddLayerNorm") if cfg.layer_norm else ("RMSNorm" + variant, "AddRMSNorm" + variant)

    def norm_weight(name: str, hf_name: str) -> str:
        weight(name, hf_name)
        if fold:
            load = g.weights[name]
            g.weights[name] = lambda: load() + 1
        return name

    def norm(x: str, residual: str | None, name: str, hf_name: str, out: str):
        return _norm(g, x, residual, norm_weight(name, hf_name), cfg.rms_norm_eps, out, ops)
    norm.weight, norm.variant = norm_weight, variant
    return norm


def head_source(ckpt: Checkpoint, cfg: ModelConfig) -> str:
    """The float tensor the logits read: the embedding for a tied model (or one without lm_head.weight)."""
    return EMBED if cfg.tie_word_embeddings or not ckpt.has("lm_head.weight") else "lm_head.weight"


def _weight_binder(ckpt: Checkpoint, g: Graph, dtype: torch.dtype):
    def bind(name: str, hf_name: str, cast: bool = True) -> str:
        if not ckpt.has(hf_name):
            raise UserError(f"checkpoint {ckpt.name} is missing tensor '{hf_name}'")
        # inv_freq and norms stay exact in float32 only when the model is float32; bf16 models
        # keep norm weights in bf16 like the HF reference does. Packed int4 tensors keep their type.
        g.weights[name] = ((lambda: ckpt.get(hf_name).to(dtype).contiguous()) if cast
                           else (lambda: ckpt.get(hf_name).contiguous()))
        return name
    bind.has = ckpt.has
    bind.quant_config = ckpt.hf_config.get("quantization_config") or {}
    return bind


def _linear(g: Graph, x: str, weight, name: str, hf_prefix: str, bias: bool, in_features: int) -> str:
    if weight.has(hf_prefix + ".qweight"):
        return _qlinear(g, x, weight, name, hf_prefix, bias, in_features)
    inputs = [x, weight(name + ".weight", hf_prefix + ".weight")]
    if bias:
        inputs.append(weight(name + ".bias", hf_prefix + ".bias"))
    return g.onnx_op("Gemm", inputs, name + ".out", transB=1)


def _qlinear(g: Graph, x: str, weight, name: str, hf_prefix: str, bias: bool, in_features: int) -> str:
    """An int4 projection (frontend/quantized.py gives its tensors in the engc int4 layout)."""
    from engc.compiler.frontend.quantized import group_size
    inputs = [x, weight(name + ".qweight", hf_prefix + ".qweight", cast=False),
              weight(name + ".scales", hf_prefix + ".scales"),
              weight(name + ".zeros", hf_prefix + ".zeros", cast=False)]
    if bias:
        inputs.append(weight(name + ".bias", hf_prefix + ".bias"))
    act_order = weight.has(hf_prefix + ".perm")
    if act_order:
        inputs.append(weight(name + ".perm", hf_prefix + ".perm", cast=False))
    # a GGUF Q4_1 / Q4_K weight's float group minimums (frontend/gguf_quant.py); the attribute exists only
    # where they do, so AWQ/GPTQ programs carry none
    offsets = {"has_offsets": 1} if weight.has(hf_prefix + ".offsets") else {}
    if offsets:
        inputs.append(weight(name + ".offsets", hf_prefix + ".offsets"))
    return g.add("QLinear", inputs, name + ".out", has_bias=bias, act_order=act_order,
                 group_size=group_size(weight.quant_config, in_features), **offsets)


def _scale_output(g: Graph, name: str, factor: float) -> None:
    """A projection whose output HF multiplies by factor (Granite's residual_multiplier): the factor folded into
    what makes its output, the weight (an int4 one's scales and offsets; stacked experts' float tensor, named
    as the projection) and bias, in float32, then rounded to their dtype once. int4 codes stay as they are."""
    if factor == 1.0:
        return
    for key in (name + s for s in ("", ".weight", ".scales", ".offsets", ".bias") if name + s in g.weights):
        def scaled(load=g.weights[key]):
            w = load()
            return (w.float() * factor).to(w.dtype) if w.is_floating_point() else w
        g.weights[key] = scaled


def _concat(g: Graph, parts: list[str], name: str) -> str:
    return g.onnx_op("Concat", parts, name, axis=-1)


def _residual_sum(g: Graph, x: str, residual: str | None, name: str, hf_name: str, out: str):
    """A pre-norm's place where the family has none (OLMo 2): the block reads the residual stream itself, the
    sum of the residual and the previous block's (post-normed) output; (input, residual) as a norm returns."""
    if residual is None:
        return x, x
    total = g.onnx_op("Add", [x, residual], out + ".sum")
    return total, total


def _norm(g: Graph, x: str, residual: str | None, w: str, eps: float, name: str,
          ops: tuple[str, str] = ("RMSNorm", "AddRMSNorm")):
    """ops: the family's norm and its residual-adding form (RMSNorm, its UnitOffset variants, or LayerNorm)."""
    if residual is None:
        # The first block: the embedding itself is the residual stream.
        return g.add(ops[0], [x, w], name, eps=eps), x
    out, res = g.add(ops[1], [x, residual, w], [name, name + ".residual"], eps=eps)
    return out, res
