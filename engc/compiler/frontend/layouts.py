"""Checkpoint tensor layouts other than HF Llama's, seen under Llama's names so one lowering reads them all.

Each view is lazy, like the checkpoint: a renamed tensor loads its source; a split one loads the fused
source and takes its rows (the passes fuse q/k/v and gate/up again into the GEMMs the GPU runs).
- text_part: a multimodal checkpoint's language model (Gemma 3: `language_model.model.*` and
  `language_model.lm_head.*` in the released files, `model.language_model.*` and `lm_head.*` as transformers
  5 saves them); the vision tower is left out.
- phi3: `qkv_proj` rows are q, k, v; `gate_up_proj` rows are gate, then up.
- granitemoe: `block_sparse_moe.input_linear` / `output_linear` are the stacked experts transformers 5
  calls `mlp.experts.gate_up_proj` / `down_proj`, `block_sparse_moe.router.layer` the router `mlp.gate`.
- internlm2: `attention.wqkv` rows are grouped per KV head, [q heads of the group..., k, v] (the published
  modeling code's rearrange "(h gs d)"), `w1`/`w3`/`w2` are gate/up/down, `attention_norm`/`ffn_norm` the
  two norms, `tok_embeddings` and `output` the embedding and the head.
- partial rotary (Phi-4-mini's partial_rotary_factor): q and k rows are permuted inside each head so the
  rotated dims pair up as rotate-half pairs across the whole head (i with i + head_dim/2) and the
  unrotated dims sit where the rotary frequencies are zero (rope.py pads them): the rotary op stays one
  formula; q.k is a sum over the same products, and v is untouched.

A quantized projection in the engc int4 layout (frontend/quantized.py) has every tensor N-major, one row an
output, like a float weight: qweight [N, K/8], scales and zeros [N, groups] (and a GGUF's offsets), while
its act-order `perm` belongs to the inputs. So splitting a fused projection, or permuting q and k rows, is
the same row operation on each of them, `perm` shared by the parts; LongRoPE's row scaling scales a quantized
row's scales (and offsets), its dequantized value being (q - zero) * scale (+ offset).

engc quantize writes its output back through the same tables (quantize/source_layout.py): LAYER_TENSORS,
join_rows (split_rows' inverse) and the row permutation's inverse.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler.frontend.checkpoint import Checkpoint
from engc.errors import UserError

_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# each layout's layer tensors (relative to the layer) that Llama names otherwise: the source name -> the Llama
# names of the parts its rows hold, in order (one part: a rename)
LAYER_TENSORS = {
    "llama": {},
    "phi3": {"self_attn.qkv_proj": QKV, "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
    # GLM-4: Gemma's four norms under other names (listed in this order, so that writing a checkpoint back,
    # source_layout, renames post_attention_layernorm to post_self_attn_layernorm before it reuses the name)
    "glm4": {"mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
             "post_self_attn_layernorm": ("post_attention_layernorm",),
             "post_attention_layernorm": ("pre_feedforward_layernorm",),
             "post_mlp_layernorm": ("post_feedforward_layernorm",)},
    "granitemoe": {"block_sparse_moe.router.layer": ("mlp.gate",)},
    "internlm2": {"attention.wqkv": QKV, "attention.wo": ("self_attn.o_proj",),
                  "feed_forward.w1": ("mlp.gate_proj",), "feed_forward.w3": ("mlp.up_proj",),
                  "feed_forward.w2": ("mlp.down_proj",), "attention_norm": ("input_layernorm",),
                  "ffn_norm": ("post_attention_layernorm",)},
}
# stacked experts ([E, 2I, H] gate rows then up rows, [E, H, I]) under transformers' fused experts' names
STACKED_EXPERTS = {"granitemoe": {"block_sparse_moe.input_linear.weight": "mlp.experts.gate_up_proj",
                                  "block_sparse_moe.output_linear.weight": "mlp.experts.down_proj"}}
# the tensors outside the layers that Llama names otherwise: source prefix -> Llama's
GLOBAL_NAMES = {"internlm2": (("model.tok_embeddings.", "model.embed_tokens."), ("output.", "lm_head."))}
# tensors of a projection whose rows are its outputs (float weight and bias; the engc int4 layout's), and the
# ones that belong to its inputs, which the parts of a fused projection share
ROW_TENSORS = ("weight", "bias", "qweight", "scales", "zeros", "offsets")
INPUT_TENSORS = ("perm",)
# what LongRoPE's row scaling multiplies: a float row, or the scale (and offset) of a quantized one
SCALED_TENSORS = ("weight", "bias", "scales", "offsets")


def text_config(hf: dict) -> dict:
    """A multimodal config.json's text_config, with the token ids, tying and quantization (an AWQ / GPTQ
    checkpoint's group size) the outer config holds."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UserError(f"config.json of model_type '{hf.get('model_type')}' lacks text_config")
    config = {**text, "model_type": text.get("model_type") or f"{hf['model_type']}_text"}
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings", "quantization_config"):
        if key not in config and key in hf:
            config[key] = hf[key]
    return config


def text_part(ckpt: Checkpoint) -> Checkpoint:
    """The language model of a multimodal checkpoint, its text_config as the config."""
    config = text_config(ckpt.hf_config)
    loaders = {}
    for name, load in ckpt.loaders.items():
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                loaders[new + name[len(old):]] = load
    return dataclasses.replace(ckpt, hf_config=config, loaders=loaders)


def text_source_prefix(names) -> tuple[str, str]:
    """The prefixes a multimodal checkpoint holds its text model's `model.` and `lm_head.` tensors under."""
    model = next((old for old, new in _TEXT_PREFIXES if new == "model." and any(n.startswith(old) for n in names)),
                 _TEXT_PREFIXES[0][0])
    return model, "language_model.lm_head." if model == "language_model.model." else "lm_head."


def llama_names(ckpt: Checkpoint, layout: str, cfg: ModelConfig, rotary_dim: int,
                rope_factor: float = 1.0) -> Checkpoint:
    """ckpt under HF Llama's tensor names (layout: a Family's layout fact), with q/k rows permuted for a
    partial rotary width. rope_factor: LongRoPE's multiplier of the rotated dims of q and k, which the
    lowering folds into the attention scale as its square; the unrotated dims of q are divided by that
    square here, so their share of q.k stays as HF has it."""
    if layout not in LAYER_TENSORS:
        raise ValueError(f"unknown layout {layout}")
    loaders = _layer_view(_renamed(ckpt.loaders, GLOBAL_NAMES.get(layout, ())), layout, cfg)
    if rotary_dim < cfg.head_dim and rope_factor != 1.0:
        for name in _head_rows(loaders, "q_proj", SCALED_TENSORS):
            loaders[name] = _lazy(head_rows_scaled, loaders[name], rotary_dim, cfg.head_dim, cfg.num_heads,
                                  rope_factor ** -2, name.endswith(".weight") or name.endswith(".bias"))
    if rotary_dim < cfg.head_dim or cfg.rotary_interleaved:
        perm = partial_rotary_order(cfg.head_dim, rotary_dim, cfg.rotary_interleaved)
        for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
            for name in _head_rows(loaders, proj, ROW_TENSORS):
                loaders[name] = _lazy(head_rows_permuted, loaders[name], perm, heads)
        for name in _head_rows(loaders, "[qk]_norm", ("weight",)):   # a q/k norm's weights follow their dims
            loaders[name] = _lazy(head_dims_permuted, loaders[name], perm)
    return dataclasses.replace(ckpt, loaders=loaders)


def partial_rotary_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """The order of a head's dims that puts HF's rotated pairs (i, i + rotary_dim/2), or interleaved ones
    (2i, 2i + 1) (GLM-4), at (j, j + head_dim/2) for j < rotary_dim/2 and the unrotated dims at the rest."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first, second = (torch.arange(0, 2 * r, 2), torch.arange(1, 2 * r, 2)) if interleaved else \
        (torch.arange(0, r), torch.arange(r, 2 * r))
    return torch.cat([first, torch.arange(2 * r, 2 * r + p), second, torch.arange(2 * r + p, head_dim)])


def head_rows_permuted(w: torch.Tensor, perm: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [heads * head_dim, ...] with each head's rows in the order perm."""
    return w.reshape(heads, perm.numel(), *w.shape[1:])[:, perm].reshape(w.shape).contiguous()


def head_dims_permuted(w: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """A q/k norm's weight ([head_dim], [heads, head_dim] or [heads * head_dim]) with each head's dims in the
    order perm, as the rows of the projection it norms."""
    return w.reshape(-1, perm.numel())[:, perm].reshape(w.shape).contiguous()


def head_rows_scaled(w: torch.Tensor, start: int, head_dim: int, heads: int, factor: float,
                     keep_dtype: bool = True) -> torch.Tensor:
    """Each head's rows from `start` on multiplied by factor (in float64, then rounded once: to w's dtype, or
    to float32 where keep_dtype is False, as for a quantized row's scales, which the build casts anyway)."""
    rows = w.reshape(heads, head_dim, *w.shape[1:]).double()
    rows[:, start:] *= factor
    return rows.reshape(w.shape).to(w.dtype if keep_dtype else torch.float32)


def split_rows(layout: str, source: str, cfg: ModelConfig, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A fused projection's row tensor (LAYER_TENSORS) -> its parts' rows, in the table's order."""
    if source == "attention.wqkv":   # internlm2: [KV heads, group q heads + k + v, head_dim] rows
        group = cfg.num_heads // cfg.num_kv_heads
        rows = w.reshape(cfg.num_kv_heads, group + 2, cfg.head_dim, *w.shape[1:])
        return (rows[:, :group].reshape(cfg.q_size, *w.shape[1:]), rows[:, group].reshape(cfg.kv_size, *w.shape[1:]),
                rows[:, group + 1].reshape(cfg.kv_size, *w.shape[1:]))
    if source == "self_attn.qkv_proj":
        return w.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
    return w.chunk(2)   # gate_up_proj


def join_rows(layout: str, source: str, cfg: ModelConfig, parts) -> torch.Tensor:
    """split_rows' inverse: the parts' row tensors -> the fused projection's."""
    if source == "attention.wqkv":
        q, k, v = parts
        rest = q.shape[1:]
        return torch.cat([q.reshape(cfg.num_kv_heads, -1, cfg.head_dim, *rest),
                          k.reshape(cfg.num_kv_heads, 1, cfg.head_dim, *rest),
                          v.reshape(cfg.num_kv_heads, 1, cfg.head_dim, *rest)], dim=1).reshape(-1, *rest)
    return torch.cat(list(parts))


def _lazy(fn, load, *args):
    return lambda: fn(load(), *args)


def _head_rows(loaders: dict, proj: str, tensors) -> list[str]:
    kinds = "|".join(tensors)
    return [n for n in loaders if re.fullmatch(rf"model\.layers\.\d+\.self_attn\.{proj}\.({kinds})", n)]


def _renamed(loaders: dict, prefixes) -> dict:
    out = {}
    for name, load in loaders.items():
        for old, new in prefixes:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = load
    return out


def _layer_view(loaders: dict, layout: str, cfg: ModelConfig) -> dict:
    """Each model.layers.{i}.{source}.{tensor} of the layout's table under its parts' Llama names: renamed, or
    for a fused source its row tensors split and its input tensors shared."""
    table, stacked = LAYER_TENSORS[layout], STACKED_EXPERTS.get(layout, {})
    out = {}
    for name, load in loaders.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.)(.+)", name)
        if m and m.group(2) in stacked:
            out[m.group(1) + stacked[m.group(2)]] = load
            continue
        m = re.fullmatch(r"(model\.layers\.\d+\.)(.+)\.(\w+)", name)
        if m is None or m.group(2) not in table:
            out[name] = load
            continue
        prefix, source, tensor = m.groups()
        parts = table[source]
        if len(parts) == 1 or tensor in INPUT_TENSORS:
            out.update({f"{prefix}{part}.{tensor}": load for part in parts})
        elif tensor in ROW_TENSORS:
            for i, part in enumerate(parts):
                out[f"{prefix}{part}.{tensor}"] = (
                    lambda load=load, i=i, source=source: split_rows(layout, source, cfg, load())[i].contiguous())
        else:
            raise UserError(f"checkpoint tensor '{name}': engc does not read a fused projection's '{tensor}'")
    return out
