"""engc quantize's output in the source checkpoint's own tensor names and layout.

The quantizer reads a checkpoint as the build does, under Llama's names (frontend/layouts.py: fused
projections split, q/k rows in the partial rotary order, q's unrotated rows divided by LongRoPE's factor
squared). What it writes is a normal AWQ / GPTQ checkpoint of the source family instead, so that engc build
and other tools read it as they read any such checkpoint of that family: each layer's quantized weights go
back through that view's inverse before packing. A quantized weight's codes, scales and zeros are all one
row an output, so every step is a row operation on the three, the input groups (g_idx) untouched: q and k rows
back in HF's order (and the dims of q/k norm weights), q's unrotated rows' scales multiplied by the factor
squared ((q - zero) * scale is the weight), fused projections' parts joined along the outputs (phi3's qkv_proj
and gate_up_proj, internlm2's grouped wqkv), the rest renamed (internlm2's w1/w3/w2, its norms).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler.frontend.checkpoint import Checkpoint
from engc.compiler.frontend.families import family_of
from engc.compiler.frontend.layouts import (GLOBAL_NAMES, LAYER_TENSORS, head_dims_permuted, head_rows_permuted,
                                            head_rows_scaled, join_rows, partial_rotary_order, text_config,
                                            text_source_prefix)
from engc.compiler.quantize.rtn import QuantizedWeight


@dataclass(frozen=True)
class SourceNames:
    """Where the source checkpoint keeps what the view names model.layers.{i}.* and lm_head.*."""
    layout: str
    model: str = "model."
    head: str = "lm_head."

    @classmethod
    def of(cls, source: Checkpoint) -> "SourceNames":
        family = family_of(source.hf_config)
        if family.text_config:   # a multimodal checkpoint: its language model's prefixes
            model, head = text_source_prefix(source.names())
            return cls(family_of(text_config(source.hf_config)).layout, model, head)
        head = next((old for old, new in GLOBAL_NAMES.get(family.layout, ()) if new == "lm_head."), "lm_head.")
        return cls(family.layout, head=head)

    def layer(self, i: int) -> str:
        return f"{self.model}layers.{i}."

    def is_layer_tensor(self, name: str) -> bool:
        return name.startswith(f"{self.model}layers.")


def source_layer(names: SourceNames, cfg: ModelConfig, quantized: dict[str, QuantizedWeight],
                 floats: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]):
    """One layer's quantized weights and float tensors (norms, biases; float32, under the view's names relative
    to the layer) -> the same under the source's names and layout, floats in their source dtype."""
    _hf_row_order(cfg, quantized, floats)
    floats = {k: t.to(dtypes[k]) for k, t in floats.items()}
    for source, parts in LAYER_TENSORS[names.layout].items():
        if all(p in quantized for p in parts):
            quantized[source] = _joined(names.layout, source, cfg, [quantized.pop(p) for p in parts])
        for tensor in ("weight", "bias"):   # norms (renamed), biases of fused parts (joined)
            if all(f"{p}.{tensor}" in floats for p in parts):
                rows = [floats.pop(f"{p}.{tensor}") for p in parts]
                floats[f"{source}.{tensor}"] = rows[0] if len(rows) == 1 else join_rows(names.layout, source, cfg, rows)
    return quantized, floats


def _joined(layout: str, source: str, cfg: ModelConfig, parts: list[QuantizedWeight]) -> QuantizedWeight:
    if len(parts) == 1:
        return parts[0]
    if any(not torch.equal(p.g_idx, parts[0].g_idx) for p in parts):
        # the parts read one input, so one Hessian orders their columns alike; a fused tensor has one g_idx
        raise ValueError(f"the parts of {source} were quantized with different input groups")
    join = lambda key: join_rows(layout, source, cfg, [getattr(p, key) for p in parts])  # noqa: E731
    return replace(parts[0], q=join("q"), scales=join("scales"), zeros=join("zeros"))


def _hf_row_order(cfg: ModelConfig, quantized: dict, floats: dict) -> None:
    """q and k rows (quantized and bias) back from the view's partial rotary order and LongRoPE scaling."""
    rotary = cfg.rotary_dim or cfg.head_dim
    if rotary == cfg.head_dim and not cfg.rotary_interleaved:
        return
    inverse = torch.argsort(partial_rotary_order(cfg.head_dim, rotary, cfg.rotary_interleaved))
    for proj, heads in (("self_attn.q_proj", cfg.num_heads), ("self_attn.k_proj", cfg.num_kv_heads)):
        if proj in quantized:
            qw = quantized[proj]
            quantized[proj] = replace(qw, **{k: head_rows_permuted(getattr(qw, k), inverse, heads)
                                             for k in ("q", "scales", "zeros")})
        if proj + ".bias" in floats:
            floats[proj + ".bias"] = head_rows_permuted(floats[proj + ".bias"], inverse, heads)
    # q/k norm weights follow their dims (Cohere's per head, GLM-4.5's one for every head)
    for norm in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        if norm in floats:
            floats[norm] = head_dims_permuted(floats[norm], inverse)
    factor = cfg.rope_attention_factor ** 2
    if factor != 1.0:
        scale = lambda t: head_rows_scaled(t, rotary, cfg.head_dim, cfg.num_heads, factor)  # noqa: E731
        if "self_attn.q_proj" in quantized:
            qw = quantized["self_attn.q_proj"]
            quantized["self_attn.q_proj"] = replace(qw, scales=scale(qw.scales))
        if "self_attn.q_proj.bias" in floats:
            floats["self_attn.q_proj.bias"] = scale(floats["self_attn.q_proj.bias"])
