"""One decoder layer in plain torch, over a batch of calibration sequences [B, T, hidden].

Built from the same op references the runtime uses (engc.kernels) and driven by the resolved ModelConfig
alone, so the quantizer sees exactly the network the bundle runs, for every family the lowering computes
(frontend/decoder.py), without transformers: (1 + weight) norms and Gemma's sandwich norms, q/k norms (a
head's, or OLMoE's over the whole projection), the GLU's activation, the attention's scale and soft-cap, each
layer's window and rope table (none on SmolLM3's NoPE layers), Granite's residual multiplier. Weights are a
dict keyed by Llama's names relative to the layer ("self_attn.q_proj.weight", ...) as frontend/layouts.py
shows every layout (q/k rows in the partial rotary order, LongRoPE's scaling applied); the quantizers swap
entries of it and re-run pieces.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engc.bundle.model_config import ModelConfig
from engc.kernels.layer_norm import layer_norm
from engc.kernels.rms_norm import rms_norm, rms_norm_unit_offset
from engc.kernels.rotary import cos_sin, rotate

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
ATTN_NORM = "input_layernorm"
GLU_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda g: F.gelu(g, approximate="tanh")}


class DecoderLayer:
    """inv_freq: the rope table of the global layers, as the build makes it (zeros for a partial rotary's
    unrotated dims); local_inv_freq: the one of the layers with a window where it differs (Gemma 3); index:
    the layer's number, for its window."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], inv_freq: torch.Tensor,
                 index: int = 0, local_inv_freq: torch.Tensor | None = None, qk_norm_projection: bool = False):
        self.cfg, self.w, self.index = cfg, weights, index
        self.qk_norm_projection = qk_norm_projection   # OLMoE: q and k normed over the whole projection
        self.moe = None   # an MoE layer's MLP in place of the dense one (quantize/experts.py: MoeMlp)
        self._rotary: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.window, self.nope = 0, False
        if cfg is not None:
            self.window = cfg.layer_windows[index] if cfg.layer_windows else cfg.sliding_window
            self.nope = index in cfg.nope_layers   # SmolLM3's NoPE layers: no rotary, as the build's zero table
        self.local = local_inv_freq is not None and bool(self.window)   # its table unscaled (Gemma 3, OLMo 3)
        self.inv_freq = local_inv_freq if self.local else inv_freq
        if self.nope:
            self.inv_freq = torch.zeros_like(inv_freq)

    @property
    def mlp_norm(self) -> str:
        """The norm whose output the MLP reads (AWQ folds gate/up's scales into it): a parallel block's is the
        attention's."""
        if self.cfg.parallel_block:
            return ATTN_NORM
        return "pre_feedforward_layernorm" if self.cfg.sandwich_norms else "post_attention_layernorm"

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        norm = layer_norm if self.cfg.layer_norm else rms_norm_unit_offset if self.cfg.norm_unit_offset else rms_norm
        return norm(x, self.w[name + ".weight"], self.cfg.rms_norm_eps)

    def divide_norm(self, name: str, s: torch.Tensor) -> None:
        """The norm's output divided by s per channel: its scale is w, or 1 + w for a unit-offset norm."""
        w = self.w[name + ".weight"]
        self.w[name + ".weight"] = (1 + w) / s - 1 if self.cfg.norm_unit_offset else w / s

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    # --- the pieces, each taking the input of its first projection ------------------------------

    def attn_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, ATTN_NORM) if self.cfg.pre_norms else x   # OLMo 2: the residual stream itself

    def attn_context(self, h: torch.Tensor) -> torch.Tensor:
        """Normed hidden [B, T, D] -> attention output before o_proj [B, T, heads * head_dim]."""
        c = self.cfg
        b, t, _ = h.shape
        q, k = self.linear(h, "self_attn.q_proj"), self.linear(h, "self_attn.k_proj")
        if self.qk_norm_projection:
            q, k = self.norm(q, "self_attn.q_norm"), self.norm(k, "self_attn.k_norm")
        q, k = q.view(b * t, c.num_heads, c.head_dim), k.view(b * t, c.num_kv_heads, c.head_dim)
        v = self.linear(h, "self_attn.v_proj").view(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.norm(q, "self_attn.q_norm"), self.norm(k, "self_attn.k_norm")
        cos, sin = self.rotary(b, t)
        q = rotate(q, cos, sin).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = rotate(k, cos, sin).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.transpose(1, 2)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # the lowering's PagedAttention scale: LongRoPE's factor multiplies both q and k's rotated dims
        scaled = not (self.nope or self.local)   # the layer's table carries the rope scaling (decoder.py's rule)
        scale = (c.attn_scale or c.head_dim ** -0.5) * (c.rope_attention_factor ** 2 if scaled else 1.0)
        pos = torch.arange(t)
        mask = None
        if self.window:
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.window)
        if c.attn_logit_softcap:   # capped after the scale, before the mask (kernels/paged_attention)
            scores = q @ k.transpose(-1, -2) * scale
            scores = torch.tanh(scores / c.attn_logit_softcap) * c.attn_logit_softcap
            visible = mask if mask is not None else pos[None, :] <= pos[:, None]
            o = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
        return o.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim)

    def rotary(self, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of positions 0..t-1 for b sequences, made once per shape (searches re-run attention)."""
        if (b, t) not in self._rotary:
            self._rotary[(b, t)] = cos_sin(torch.arange(t).repeat(b), self.inv_freq)
        return self._rotary[(b, t)]

    def attn_out(self, context: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention's context, and Gemma's norm of it before the residual add."""
        out = self.linear(context, "self_attn.o_proj")
        return self.norm(out, "post_attention_layernorm") if self.cfg.sandwich_norms else out

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        return self.attn_out(self.attn_context(h))

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.mlp_norm) if self.cfg.pre_norms else x

    def mlp_residual(self, x: torch.Tensor) -> torch.Tensor:
        """What the MLP's input norm reads, from the layer's input x: the sum after the attention (as forward
        makes it), or (a parallel block, Cohere) x itself, which the attention's norm reads too (mlp_norm)."""
        if self.cfg.parallel_block:
            return x
        return x + self.attention(self.attn_in(x)) * self.cfg.residual_scale

    def mlp_input(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's input from the layer's input x."""
        return self.mlp_in(self.mlp_residual(x))

    def mlp_act(self, h: torch.Tensor) -> torch.Tensor:
        # silu_mul's / gelu_tanh_mul's arithmetic on the two halves they would split, without concatenating them
        return GLU_ACTIVATIONS[self.cfg.hidden_act](self.linear(h, "mlp.gate_proj")) * self.linear(h, "mlp.up_proj")

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(self, h)
        out = self.linear(self.mlp_act(h), "mlp.down_proj")
        return self.norm(out, "post_feedforward_layernorm") if self.cfg.sandwich_norms else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Granite's residual_multiplier scales each block's output (1 elsewhere; the build folds it into o and down)
        m = self.cfg.residual_scale
        if self.cfg.parallel_block:   # Cohere: one norm's output for both, added as HF adds them
            h = self.attn_in(x)
            return x + self.attention(h) + self.mlp(h)
        x = x + self.attention(self.attn_in(x)) * m
        return x + self.mlp(self.mlp_in(x)) * m


def batched(fn, *xs: torch.Tensor, rows: int = 8) -> torch.Tensor:
    """fn over xs, each [B, ...], a few sequences at a time: bounds the activations of the wide MLP."""
    return torch.cat([fn(*(x[i:i + rows] for x in xs)) for i in range(0, xs[0].shape[0], rows)])
