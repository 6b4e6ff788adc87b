"""The resolved model config: what the compiler decided about the model, recorded in the manifest.

Frontends translate each family's config.json into this one shape; the runtime reads it back and never
sees a family-specific field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False             # q and k normed per head (Qwen3, Gemma 3)
    qk_norm_projection: bool = False  # q and k each normed over its whole projection (OLMoE)
    rope_scaling: dict | None = None
    sliding_window: int = 0           # 0: full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # a mixture-of-experts MLP (0 experts: dense): experts a layer, routed a token, each one's intermediate
    # size, and the always-on shared expert's (0: none); the routing variant is the MoE node's attributes
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # the router scores float32 logits (DeepSeek's routings, GLM-4.5's, ERNIE 4.5's: sigmoid or softmax scores,
    # groups, a correction bias): the GPU build compiles the float32 router and the scored route kernel
    moe_scored_routing: bool = False
    # what the layers compute beyond Llama's (Gemma, Phi-3); the program's nodes carry each as attributes
    hidden_act: str = "silu"          # the MLP's GLU activation: silu, gelu_pytorch_tanh
    attn_scale: float = 0.0           # q.k scale (0: head_dim ** -0.5); Gemma's query_pre_attn_scalar ** -0.5
    attn_logit_softcap: float = 0.0   # attention scores capped to cap * tanh(score / cap) (0: none)
    final_logit_softcap: float = 0.0  # the same on the logits
    layer_windows: tuple[int, ...] = ()   # each layer's sliding window (0: global) where layers differ
    local_rope_theta: float = 0.0     # the rope base of the layers with a window, where it differs (Gemma 3)
    nope_layers: tuple[int, ...] = ()     # layers whose attention rotates nothing (SmolLM3's every fourth)
    rotary_dim: int = 0               # the rotated width of a head where it is less than head_dim
    # the checkpoint rotates interleaved pairs (2j, 2j + 1) of q's and k's rotated dims (GLM-4), where the
    # kernels rotate halves: the build permutes those rows (frontend/layouts.py partial_rotary_order)
    rotary_interleaved: bool = False
    rope_attention_factor: float = 1.0    # LongRoPE's multiplier of the rotated dims of q and k
    norm_unit_offset: bool = False    # RMSNorm scales by (1 + weight) (Gemma)
    sandwich_norms: bool = False      # attention and MLP outputs are normed before the residual add
    pre_norms: bool = True            # a norm before the attention and the MLP (OLMo 2: none, its inputs the sum)
    layer_norm: bool = False          # the norms subtract the mean (Cohere's LayerNorm without bias), not RMSNorm
    parallel_block: bool = False      # attention and MLP read one norm's output, both added to the residual (Cohere)
    embed_scale: float = 0.0          # the embedding is multiplied by this (Gemma: sqrt(hidden_size))
    # Granite: each attention and MLP output times residual_scale before the residual add (the build folds it
    # into o_proj's and down_proj's weights), and the logits times logit_scale (1 / logits_scaling)
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    # multi-head latent attention (DeepSeek-V2/V3; 0: none): the KV cache holds per token the normed latent
    # (kv_lora_rank values) and the rotated shared key (qk_rope_head_dim); heads are qk_nope_head_dim +
    # qk_rope_head_dim wide for q.k (head_dim) and v_head_dim for v; q_lora_rank 0: q straight from x
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def mlp_sizes(self) -> tuple[int, ...]:
        """The intermediate widths of the program's dense GLUs: the dense MLP's and a shared expert's (MoE layers
        lower their shared expert as a dense GLU beside the MoE node), each with its own kernels."""
        return tuple(sorted({self.intermediate_size, self.shared_expert_intermediate_size} - {0}))

    @property
    def kv_cache_row(self) -> tuple[int, int, int]:
        """(K-and-V planes, rows a token, values a row) of one layer's cache: [2, KV heads, head_dim], or for
        latent attention one plane of one row, the latent then the rope key."""
        if self.kv_lora_rank:
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_windows"] = list(self.layer_windows)
        d["nope_layers"] = list(self.nope_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["layer_windows"] = tuple(d.get("layer_windows") or ())
        d["nope_layers"] = tuple(d.get("nope_layers") or ())
        return cls(**d)
