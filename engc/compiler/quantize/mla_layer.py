"""The quantizer's decoder layer of DeepSeek-V2/V3: multi-head latent attention in plain torch, from the
references of kernels/mla_attention, on the checkpoint's own weights.

The weights stay as DeepSeek's checkpoint holds them (HF names relative to the layer, rope rows interleaved,
no attention factor folded in: the written checkpoint is the source's layout, row for row); what the build
lays out in the weights (frontend/mla.py) is done here to the activations instead: each head's rope dims put
in rotate-half order and times YaRN's attention factor, kv_b_proj split per head into the key and value
up-projections. kv_b_proj is read, never quantized: the build absorbs it per head (docs/quantization.md).
"""
from __future__ import annotations

import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler.frontend.mla import LATENT_NORM_EPS
from engc.compiler.frontend.rope import mla_softmax_scale
from engc.compiler.quantize.layer import LINEARS, DecoderLayer
from engc.kernels import rotary
from engc.kernels.mla_attention import attend_decompressed, rotated_query
from engc.kernels.rms_norm import rms_norm

KV_A, KV_B, O = "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj"
Q, Q_A, Q_B = "self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj"
Q_A_NORM = "self_attn.q_a_layernorm"
# the projections that read one input: GPTQ's true-sequential stages need them apart
MLP_LINEARS = LINEARS[4:]


def attention_linears(cfg: ModelConfig) -> tuple[str, ...]:
    """The attention projections engc quantize packs (kv_b_proj stays float)."""
    if not cfg.kv_lora_rank:
        return LINEARS[:4]
    return ((Q_A, Q_B) if cfg.q_lora_rank else (Q,)) + (KV_A, O)


def gptq_stages(cfg: ModelConfig) -> tuple:
    """GPTQ's true-sequential stages of the attention: (projections, their input from the layer's input x)."""
    first = (Q_A if cfg.q_lora_rank else Q, KV_A)
    stages = ((first, lambda L, x: L.attn_in(x)),)
    if cfg.q_lora_rank:
        stages += (((Q_B,), lambda L, x: L.q_latent(L.attn_in(x))),)
    return stages + (((O,), lambda L, x: L.attn_context(L.attn_in(x))),)


class MlaLayer(DecoderLayer):
    """DecoderLayer with DeepSeek's attention; the norms, the MLP (dense or MoeMlp) and the residuals as for
    every family. interleave: the checkpoint's rope dims are interleaved pairs (frontend/mla.interleaved: the
    build permutes the weights' rows, so no ModelConfig field records it)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], inv_freq: torch.Tensor,
                 index: int = 0, interleave: bool = True):
        super().__init__(cfg, weights, inv_freq, index)
        self.interleave = interleave

    def q_latent(self, h: torch.Tensor) -> torch.Tensor:
        """q_a_proj's output normed: q_b_proj's input (q_lora_rank models)."""
        return rms_norm(self.linear(h, Q_A), self.w[Q_A_NORM + ".weight"], LATENT_NORM_EPS)

    def divide_norm(self, name: str, s: torch.Tensor) -> None:
        if name == Q_A_NORM:   # by w, as q_latent and the build's LatentRMSNorm scale, whatever the other norms do
            self.w[name + ".weight"] = self.w[name + ".weight"] / s
        else:
            super().divide_norm(name, s)

    def divide_values(self, s: torch.Tensor) -> None:
        """The attention's context [.., heads * v_head_dim] divided by s per channel: the value rows of kv_b_proj
        (w_uv, a head's v_head_dim rows after its nope key rows) divided, as a dense layer's v_proj rows take
        o_proj's AWQ scale. kv_b_proj is not quantized, so the fold moves no quantization error into it."""
        c = self.cfg
        kv_b = self.w[KV_B + ".weight"].view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        values = kv_b[:, c.qk_nope_head_dim:] / s.view(c.num_heads, c.v_head_dim, 1)
        self.w[KV_B + ".weight"] = torch.cat([kv_b[:, :c.qk_nope_head_dim], values], dim=1).reshape(-1, c.kv_lora_rank)

    def rope_dims(self, x: torch.Tensor, keep: int) -> torch.Tensor:
        """x [..., keep + rope] with the rope dims in rotate-half order and times the attention factor."""
        c = self.cfg
        pe = x[..., keep:]
        if self.interleave:
            pe = torch.cat([pe[..., 0::2], pe[..., 1::2]], dim=-1)
        return torch.cat([x[..., :keep], pe * c.rope_attention_factor], dim=-1)

    def attn_context(self, h: torch.Tensor, latent: torch.Tensor | None = None) -> torch.Tensor:
        """Normed hidden [B, T, D] -> attention output before o_proj [B, T, heads * v_head_dim]. latent: q_b_proj's
        input where given, q_latent(h) otherwise (AWQ's search of q_b_proj scores the attention on its candidates)."""
        c = self.cfg
        b, t, _ = h.shape
        heads, nope, rope, r = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        if c.q_lora_rank:
            q = self.linear(self.q_latent(h) if latent is None else latent, Q_B)
        else:
            q = self.linear(h, Q)
        q = self.rope_dims(q.view(b, t, heads, nope + rope), nope).reshape(b, t, -1)
        ckv = self.rope_dims(self.linear(h, KV_A), r)
        kv_b = self.w[KV_B + ".weight"].view(heads, nope + c.v_head_dim, r)
        w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
        scale = mla_softmax_scale(c.rope_scaling, (nope + rope) ** -0.5)
        positions = torch.arange(t)
        cos, sin = rotary.cos_sin(positions, self.inv_freq)
        out = []
        for s in range(b):   # the cached rows the kernel writes: the normed latent, then the rotated rope key
            rows = torch.cat([rms_norm(ckv[s, :, :r], self.w["self_attn.kv_a_layernorm.weight"], LATENT_NORM_EPS),
                              rotary.rotate(ckv[s, :, None, r:], cos, sin)[:, 0]], dim=-1)
            q_nope, q_pe = rotated_query(q[s], positions, self.inv_freq, heads, nope, rope)
            out.append(attend_decompressed(q_nope, q_pe, rows.float(), w_uk, w_uv, scale, r).reshape(t, -1))
        return torch.stack(out)
