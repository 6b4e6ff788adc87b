"""One decoder layer in plain torch, over a batch of calibration sequences [B, T, hidden].

Built from the same op references the runtime uses (engc.kernels), so the quantizer sees exactly the
network the bundle runs, without transformers. Weights are a dict keyed by HF names relative to the
layer ("self_attn.q_proj.weight", ...); the quantizers swap entries of it and re-run pieces.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engc.bundle.model_config import ModelConfig
from engc.kernels.rms_norm import rms_norm
from engc.kernels.rotary import cos_sin, rotate

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], inv_freq: torch.Tensor):
        self.cfg, self.w, self.inv_freq = cfg, weights, inv_freq
        self.moe = None   # an MoE layer's MLP in place of the dense one (quantize/experts.py: MoeMlp)
        self._rotary: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    # --- the pieces, each taking the input of its first projection ------------------------------

    def attn_in(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.w["input_layernorm.weight"], self.cfg.rms_norm_eps)

    def attn_context(self, h: torch.Tensor) -> torch.Tensor:
        """Normed hidden [B, T, D] -> attention output before o_proj [B, T, heads * head_dim]."""
        c = self.cfg
        b, t, _ = h.shape
        q = self.linear(h, "self_attn.q_proj").view(b * t, c.num_heads, c.head_dim)
        k = self.linear(h, "self_attn.k_proj").view(b * t, c.num_kv_heads, c.head_dim)
        v = self.linear(h, "self_attn.v_proj").view(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, self.w["self_attn.q_norm.weight"], c.rms_norm_eps)
            k = rms_norm(k, self.w["self_attn.k_norm.weight"], c.rms_norm_eps)
        cos, sin = self.rotary(b, t)
        q = rotate(q, cos, sin).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = rotate(k, cos, sin).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.transpose(1, 2)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = None
        if c.sliding_window:
            pos = torch.arange(t)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - c.sliding_window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=c.head_dim ** -0.5)
        return o.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim)

    def rotary(self, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of positions 0..t-1 for b sequences, made once per shape (searches re-run attention)."""
        if (b, t) not in self._rotary:
            self._rotary[(b, t)] = cos_sin(torch.arange(t).repeat(b), self.inv_freq)
        return self._rotary[(b, t)]

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(self.attn_context(h), "self_attn.o_proj")

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.w["post_attention_layernorm.weight"], self.cfg.rms_norm_eps)

    def mlp_act(self, h: torch.Tensor) -> torch.Tensor:
        # silu_mul's arithmetic on the two halves it would split, without concatenating them first
        return F.silu(self.linear(h, "mlp.gate_proj")) * self.linear(h, "mlp.up_proj")

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(self, h)
        return self.linear(self.mlp_act(h), "mlp.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attn_in(x))
        return x + self.mlp(self.mlp_in(x))


def batched(fn, x: torch.Tensor, rows: int = 8) -> torch.Tensor:
    """fn over x [B, ...] a few sequences at a time: bounds the activations of the wide MLP."""
    return torch.cat([fn(x[i:i + rows]) for i in range(0, x.shape[0], rows)])
