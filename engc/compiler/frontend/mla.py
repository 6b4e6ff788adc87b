"""Multi-head latent attention (DeepSeek-V2/V3): config facts and the lowering of one layer's attention.

The layer computes q (q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj with q_lora_rank), the compressed kv
(kv_a_proj_with_mqa: a kv_lora_rank latent and one rope key shared by the heads), and one MLAAttention node
(kernels/mla_attention), which caches the latent and the rotated rope key and attends over them; o_proj after.
What is laid out at build time, recorded in the bundle as weights:
- kv_b_proj split per head into the key up-projection w_uk [H, nope, R] and the value one w_uv [H, v, R], the
  matrices the decode form absorbs into the query (q_nope @ w_uk) and the output (o_latent @ w_uv.T). They
  stay apart from q_b_proj and o_proj: multiplied into them, those would grow R / nope times (4x for DeepSeek)
  and so would the bytes a decode step reads.
- DeepSeek's interleaved rope pairs (x0, x1), (x2, x3)... permuted into rotate-half order, in q's rope rows and
  the rope key's rows of kv_a_proj alike, so q.k is unchanged and the rotary is the one every family uses.
- YaRN's attention factor (its multiplier of cos and sin) folded into those rows, the rotation being linear.
"""
from __future__ import annotations

import torch

from engc.compiler.frontend.families import Family
from engc.compiler.frontend.rope import mla_softmax_scale
from engc.compiler.ir import Graph
from engc.errors import UserError


def mla_facts(hf: dict) -> dict:
    """ModelConfig fields of a latent-attention model: head_dim is q.k's width (nope + rope); num_kv_heads is
    num_heads (each head has its own key and value once decompressed)."""
    try:
        nope, rope, v = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"]), int(hf["v_head_dim"])
        facts = dict(kv_lora_rank=int(hf["kv_lora_rank"]), q_lora_rank=int(hf.get("q_lora_rank") or 0),
                     qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, head_dim=nope + rope,
                     num_kv_heads=int(hf["num_attention_heads"]))
    except KeyError as e:
        raise UserError(f"config.json lacks {e.args[0]}, needed for multi-head latent attention") from None
    if rope % 2 or rope <= 0:
        raise UserError(f"qk_rope_head_dim {rope} must be even and positive")
    if hf.get("attention_bias"):
        raise UserError("config.json sets attention_bias: true for a latent-attention model, which engc does not "
                        "support")
    return facts


def interleaved(hf: dict, family: Family) -> bool:
    key = family.rope_interleave
    return bool(hf.get(key, True)) if isinstance(key, str) else bool(key)


def _rope_rows(w: torch.Tensor, groups: int, keep: int, rope: int, interleave: bool, factor: float):
    """w's rows as [groups, keep + rope]: the rope rows of each group permuted from interleaved pairs to
    rotate-half order (evens, then odds) and times the rope attention factor."""
    w = w.reshape(groups, keep + rope, -1)
    pe = w[:, keep:]
    if interleave:
        pe = torch.cat([pe[:, 0::2], pe[:, 1::2]], dim=1)
    return torch.cat([w[:, :keep], pe * factor], dim=1).reshape(groups * (keep + rope), -1)


def lower_mla(g: Graph, h: str, weight, cfg, hf: dict, family: Family, layer: int, dtype: torch.dtype) -> str:
    """One layer's attention on the normed hidden state h; returns o_proj's output."""
    p, a = f"layers.{layer}.", f"model.layers.{layer}.self_attn."
    heads, nope, rope, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    interleave, factor = interleaved(hf, family), cfg.rope_attention_factor

    def laid_out(name: str, hf_name: str, transform) -> str:
        weight(name, hf_name)
        load = g.weights[name]
        g.weights[name] = lambda: transform(load()).to(dtype).contiguous()
        return name

    def gemm(x: str, name: str, hf_name: str, transform=None) -> str:
        w = laid_out(p + name + ".weight", a + hf_name + ".weight", transform) if transform \
            else weight(p + name + ".weight", a + hf_name + ".weight")
        return g.onnx_op("Gemm", [x, w], p + name + ".out", transB=1)

    q_rows = lambda w: _rope_rows(w, heads, nope, rope, interleave, factor)  # noqa: E731
    if cfg.q_lora_rank:
        qa = gemm(h, "q_a", "q_a_proj")
        qa = g.add("LatentRMSNorm", [qa, weight(p + "q_a_norm.weight", a + "q_a_layernorm.weight")],
                   p + "q_a.normed", eps=cfg.rms_norm_eps)
        q = gemm(qa, "q_b", "q_b_proj", q_rows)
    else:
        q = gemm(h, "q", "q_proj", q_rows)
    ckv = gemm(h, "kv_a", "kv_a_proj_with_mqa", lambda w: _rope_rows(w, 1, r, rope, interleave, factor))
    kv_b = lambda w: w.reshape(heads, nope + cfg.v_head_dim, r)  # noqa: E731
    w_uk = laid_out(p + "attn.w_uk", a + "kv_b_proj.weight", lambda w: kv_b(w)[:, :nope])
    w_uv = laid_out(p + "attn.w_uv", a + "kv_b_proj.weight", lambda w: kv_b(w)[:, nope:])
    scale = mla_softmax_scale(cfg.rope_scaling, (nope + rope) ** -0.5)
    attn = g.add("MLAAttention", [q, ckv, weight(p + "kv_a_norm.weight", a + "kv_a_layernorm.weight"), "positions",
                                  "rope.inv_freq", f"kv_cache.{layer}", "slot_mapping", "block_tables",
                                  "context_lens", "query_start_loc", w_uk, w_uv], p + "attn",
                 num_heads=heads, kv_lora_rank=r, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                 v_head_dim=cfg.v_head_dim, scale=scale, eps=cfg.rms_norm_eps)
    return gemm(attn, "o", "o_proj")
