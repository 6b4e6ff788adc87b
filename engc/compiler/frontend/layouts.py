"""Checkpoint tensor layouts other than HF Llama's, seen under Llama's names so one lowering reads them all.

Each view is lazy, like the checkpoint: a renamed tensor loads its source; a split one loads the fused
source and takes its rows (the passes fuse q/k/v and gate/up again into the GEMMs the GPU runs).
- text_part: a multimodal checkpoint's language model (Gemma 3: `language_model.model.*` in the released
  files, `model.language_model.*` as transformers 5 saves them); the vision tower is left out.
- phi3: `qkv_proj` rows are q, k, v; `gate_up_proj` rows are gate, then up.
- internlm2: `attention.wqkv` rows are grouped per KV head, [q heads of the group..., k, v] (the published
  modeling code's rearrange "(h gs d)"), `w1`/`w3`/`w2` are gate/up/down, `attention_norm`/`ffn_norm` the
  two norms, `tok_embeddings` and `output` the embedding and the head.
- partial rotary (Phi-4-mini's partial_rotary_factor): q and k rows are permuted inside each head so the
  rotated dims pair up as rotate-half pairs across the whole head (i with i + head_dim/2) and the
  unrotated dims sit where the rotary frequencies are zero (rope.py pads them): the rotary op stays one
  formula; q.k is a sum over the same products, and v is untouched.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler.frontend.checkpoint import Checkpoint
from engc.errors import UserError

_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))

_INTERNLM2_NAMES = (
    (r"model\.tok_embeddings\.", "model.embed_tokens."),
    (r"output\.", "lm_head."),
    (r"(model\.layers\.\d+\.)attention\.wo\.", r"\1self_attn.o_proj."),
    (r"(model\.layers\.\d+\.)feed_forward\.w1\.", r"\1mlp.gate_proj."),
    (r"(model\.layers\.\d+\.)feed_forward\.w3\.", r"\1mlp.up_proj."),
    (r"(model\.layers\.\d+\.)feed_forward\.w2\.", r"\1mlp.down_proj."),
    (r"(model\.layers\.\d+\.)attention_norm\.", r"\1input_layernorm."),
    (r"(model\.layers\.\d+\.)ffn_norm\.", r"\1post_attention_layernorm."),
)


def text_config(hf: dict) -> dict:
    """A multimodal config.json's text_config, with the token ids and tying the outer config holds."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UserError(f"config.json of model_type '{hf.get('model_type')}' lacks text_config")
    config = {**text, "model_type": text.get("model_type") or f"{hf['model_type']}_text"}
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
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


def llama_names(ckpt: Checkpoint, layout: str, cfg: ModelConfig, rotary_dim: int,
                rope_factor: float = 1.0) -> Checkpoint:
    """ckpt under HF Llama's tensor names (layout: a Family's layout fact), with q/k rows permuted for a
    partial rotary width. rope_factor: LongRoPE's multiplier of the rotated dims of q and k, which the
    lowering folds into the attention scale as its square; the unrotated dims of q are divided by that
    square here, so their share of q.k stays as HF has it."""
    loaders = dict(ckpt.loaders)
    if layout == "phi3":
        loaders = _split_fused(loaders, "self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"),
                               lambda w: w.split([cfg.q_size, cfg.kv_size, cfg.kv_size]), "self_attn.")
        loaders = _split_fused(loaders, "mlp.gate_up_proj", ("gate_proj", "up_proj"),
                               lambda w: w.chunk(2), "mlp.")
    elif layout == "internlm2":
        loaders = _renamed(loaders, _INTERNLM2_NAMES)
        loaders = _split_fused(loaders, "attention.wqkv", ("q_proj", "k_proj", "v_proj"),
                               lambda w: _grouped_qkv(w, cfg), "self_attn.")
    elif layout != "llama":
        raise ValueError(f"unknown layout {layout}")
    if rotary_dim < cfg.head_dim and rope_factor != 1.0:
        for name in [n for n in loaders if re.fullmatch(r"model\.layers\.\d+\.self_attn\.q_proj\.(weight|bias)", n)]:
            loaders[name] = _rows_scaled(loaders[name], rotary_dim, cfg.head_dim, cfg.num_heads, rope_factor ** -2)
    if rotary_dim < cfg.head_dim:
        perm = partial_rotary_order(cfg.head_dim, rotary_dim)
        for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
            for name in [n for n in loaders if re.fullmatch(rf"model\.layers\.\d+\.self_attn\.{proj}\.(weight|bias)", n)]:
                loaders[name] = _rows_permuted(loaders[name], perm, heads)
    return dataclasses.replace(ckpt, loaders=loaders)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims that puts HF's rotated pairs (i, i + rotary_dim/2) at (j, j + head_dim/2)
    for j < rotary_dim/2 and the unrotated dims at the rest."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(0, r), torch.arange(2 * r, 2 * r + p), torch.arange(r, 2 * r),
                      torch.arange(2 * r + p, head_dim)])


def _rows_permuted(load, perm: torch.Tensor, heads: int):
    def permuted():
        w = load()
        return w.reshape(heads, perm.numel(), *w.shape[1:])[:, perm].reshape(w.shape).contiguous()
    return permuted


def _rows_scaled(load, start: int, head_dim: int, heads: int, factor: float):
    def scaled():
        w = load()
        rows = w.reshape(heads, head_dim, *w.shape[1:]).clone()
        rows[:, start:] = (rows[:, start:].double() * factor).to(w.dtype)
        return rows.reshape(w.shape)
    return scaled


def _renamed(loaders: dict, rules) -> dict:
    out = {}
    for name, load in loaders.items():
        for pattern, repl in rules:
            new, n = re.subn("^" + pattern, repl, name)
            if n:
                name = new
                break
        out[name] = load
    return out


def _split_fused(loaders: dict, fused: str, parts: tuple[str, ...], split, prefix: str) -> dict:
    """Each model.layers.{i}.{fused}.weight/.bias as the parts' tensors (split: tensor -> parts in order)."""
    out = {}
    for name, load in loaders.items():
        m = re.fullmatch(rf"(model\.layers\.\d+\.){re.escape(fused)}\.(\w+)", name)
        if m is None:
            out[name] = load
            continue
        if m.group(2) not in ("weight", "bias"):
            raise UserError(f"checkpoint tensor '{name}': a quantized fused projection is not supported "
                            "(build from a float checkpoint, or a GGUF without --quant keep)")
        for i, part in enumerate(parts):
            out[f"{m.group(1)}{prefix}{part}.{m.group(2)}"] = (
                lambda load=load, i=i: split(load())[i].contiguous())
    return out


def _grouped_qkv(w: torch.Tensor, cfg: ModelConfig):
    """InternLM2's wqkv rows [KV heads, group q heads + k + v, head_dim] -> q, k, v rows."""
    group = cfg.num_heads // cfg.num_kv_heads
    rows = w.reshape(cfg.num_kv_heads, group + 2, cfg.head_dim, *w.shape[1:])
    q = rows[:, :group].reshape(cfg.q_size, *w.shape[1:])
    return q, rows[:, group].reshape(cfg.kv_size, *w.shape[1:]), rows[:, group + 1].reshape(cfg.kv_size, *w.shape[1:])
