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


# q_a_layernorm's and kv_a_layernorm's epsilon: DeepSeek's modeling code (and transformers') makes both norms with
# its RMSNorm's default, whatever rms_norm_eps says (the released configs set rms_norm_eps to the same 1e-6)
LATENT_NORM_EPS = 1e-6


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
    rotate-half order (evens, then odds) and times the rope attention factor (1.0: rows left unscaled, as an
    int4 projection's codes and zeros are, its scales carrying the factor)."""
    w = w.reshape(groups, keep + rope, -1)
    pe = w[:, keep:]
    if interleave:
        pe = torch.cat([pe[:, 0::2], pe[:, 1::2]], dim=1)
    if factor != 1.0:
        pe = pe * factor
    return torch.cat([w[:, :keep], pe], dim=1).reshape(groups * (keep + rope), -1)


def lower_mla(g: Graph, h: str, weight, cfg, hf: dict, family: Family, layer: int, dtype: torch.dtype) -> str:
    """One layer's attention on the normed hidden state h; returns o_proj's output. An int4 projection (the
    engc int4 layout, N-major: frontend/quantized.py) lowers to QLinear, the rope rows permuted alike in its
    qweight, scales and zeros and the attention factor folded into its scales; an int4 kv_b_proj is
    dequantized, its per-head split being float."""
    from engc.compiler.frontend.decoder import _qlinear   # decoder imports this module
    p, a = f"layers.{layer}.", f"model.layers.{layer}.self_attn."
    heads, nope, rope, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    interleave, factor = interleaved(hf, family), cfg.rope_attention_factor

    def transformed(name: str, transform, cast: bool = True) -> None:
        load = g.weights[name]
        g.weights[name] = lambda: (transform(load()).to(dtype) if cast else transform(load())).contiguous()

    def gemm(x: str, name: str, hf_name: str, in_features: int, rows=None) -> str:
        if weight.has(a + hf_name + ".qweight"):
            out = _qlinear(g, x, weight, p + name, a + hf_name, False, in_features)
            for key, scaled in (("qweight", False), ("zeros", False), ("scales", True), ("offsets", True)):
                if rows and p + f"{name}.{key}" in g.weights:
                    transformed(p + f"{name}.{key}", lambda w, scaled=scaled: rows(w, factor if scaled else 1.0),
                                cast=key in ("scales", "offsets"))
            return out
        w = weight(p + name + ".weight", a + hf_name + ".weight")
        if rows:
            transformed(w, lambda t: rows(t, factor))
        return g.onnx_op("Gemm", [x, w], p + name + ".out", transB=1)

    q_rows = lambda w, f: _rope_rows(w, heads, nope, rope, interleave, f)  # noqa: E731
    if cfg.q_lora_rank:
        qa = gemm(h, "q_a", "q_a_proj", cfg.hidden_size)
        qa = g.add("LatentRMSNorm", [qa, weight(p + "q_a_norm.weight", a + "q_a_layernorm.weight")],
                   p + "q_a.normed", eps=LATENT_NORM_EPS)
        q = gemm(qa, "q_b", "q_b_proj", cfg.q_lora_rank, q_rows)
    else:
        q = gemm(h, "q", "q_proj", cfg.hidden_size, q_rows)
    ckv = gemm(h, "kv_a", "kv_a_proj_with_mqa", cfg.hidden_size,
               lambda w, f: _rope_rows(w, 1, r, rope, interleave, f))
    kv_b = _kv_b_loader(g, weight, p, a + "kv_b_proj", r)
    for name, part in (("w_uk", slice(0, nope)), ("w_uv", slice(nope, None))):
        g.weights[p + "attn." + name] = lambda part=part: \
            kv_b().reshape(heads, nope + cfg.v_head_dim, r)[:, part].to(dtype).contiguous()
    scale = mla_softmax_scale(cfg.rope_scaling, (nope + rope) ** -0.5)
    attn = g.add("MLAAttention", [q, ckv, weight(p + "kv_a_norm.weight", a + "kv_a_layernorm.weight"), "positions",
                                  "rope.inv_freq", f"kv_cache.{layer}", "slot_mapping", "block_tables",
                                  "context_lens", "query_start_loc", p + "attn.w_uk", p + "attn.w_uv"], p + "attn",
                 num_heads=heads, kv_lora_rank=r, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                 v_head_dim=cfg.v_head_dim, scale=scale, eps=LATENT_NORM_EPS)
    return gemm(attn, "o", "o_proj", heads * cfg.v_head_dim)


def _kv_b_loader(g: Graph, weight, p: str, hf_prefix: str, kv_lora_rank: int):
    """The loader of kv_b_proj's float weight [H * (nope + v), R]: the checkpoint's, or its int4 one
    dequantized (AutoAWQ and GPTQ tools quantize it; engc quantize keeps it float)."""
    def source(hf_name: str):
        # the binder checks the tensor and registers its loader under a name; taken back out, it is a plain loader
        name = f"{p}kv_b.source.{hf_name.rsplit('.', 1)[1]}"
        weight(name, hf_name, cast=False)
        return g.weights.pop(name)
    if not weight.has(hf_prefix + ".qweight"):
        return source(hf_prefix + ".weight")
    from engc.compiler.frontend.quantized import dequantized
    loaders = {key: source(f"{hf_prefix}.{key}") for key in ("qweight", "scales", "zeros", "perm")
               if weight.has(f"{hf_prefix}.{key}")}
    return dequantized(lambda n: loaders[n.rsplit(".", 1)[1]](), lambda n: n.rsplit(".", 1)[1] in loaders,
                       hf_prefix, weight.quant_config, kv_lora_rank)
